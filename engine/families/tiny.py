"""Tiny random diffusers folders of each family, built from configs (tests and benchmarks; no hub).

Each `build_tiny_*` writes a complete diffusers folder with `save_pretrained`,
so it loads through exactly the path a user's folder takes. Tokenizers are
built in memory (a character-level CLIP BPE and a unigram T5 vocabulary).
"""

from __future__ import annotations

from pathlib import Path

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


def clip_tokenizer():
    """A character-level CLIP tokenizer (no merges): every letter is a token."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in LETTERS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def t5_tokenizer():
    """A unigram T5 tokenizer over single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)] + [(c, -1.0) for c in LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=32)


def clip_text_encoder(hidden: int = 16, projection: int | None = None, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=2 + 2 * len(LETTERS), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                            projection_dim=projection or hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                            hidden_act="gelu")
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(config).eval()


def t5_encoder(d_model: int = 32, umt5: bool = False, seed: int = 0):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=4 + len(LETTERS), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1,
                  num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                  decoder_start_token_id=0)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kwargs)).eval()
    return T5EncoderModel(T5Config(**kwargs)).eval()


def autoencoder_kl(latent_channels: int = 4, scaling: float = 1.5, shift: float = 0.1, seed: int = 0):
    """A 2-level KL VAE (8x smaller than SD's: images shrink by 2 per side)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                         up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], layers_per_block=1,
                         norm_num_groups=4, latent_channels=latent_channels, sample_size=32,
                         scaling_factor=scaling, shift_factor=shift, use_quant_conv=False,
                         use_post_quant_conv=False).eval()


def build_tiny_sd3(folder: str | Path, num_layers: int = 1, heads: int = 2, head_dim: int = 8,
                   sample_size: int = 16, seed: int = 0, scheduler=None) -> Path:
    """A tiny random SD3 folder: latents [4, H/2, W/2], transformer width heads·head_dim.

    `scheduler`: the folder's scheduler (default FlowMatchEulerDiscreteScheduler(shift=3.0), as SD3.5's).
    """
    tiny_sd3_pipeline(num_layers, heads, head_dim, sample_size, seed, scheduler).save_pretrained(str(folder))
    return Path(folder)


def tiny_sd3_pipeline(num_layers: int = 1, heads: int = 2, head_dim: int = 8, sample_size: int = 16,
                      seed: int = 0, scheduler=None):
    """The StableDiffusion3Pipeline of `build_tiny_sd3`, in memory (random weights from `seed`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=sample_size, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=num_layers, attention_head_dim=head_dim,
                                        num_attention_heads=heads, joint_attention_dim=32,
                                        caption_projection_dim=heads * head_dim, pooled_projection_dim=32,
                                        pos_embed_max_size=max(32, sample_size)).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=autoencoder_kl(seed=seed),
        text_encoder=clip_text_encoder(16, 16, seed + 1), tokenizer=clip_tokenizer(),
        text_encoder_2=clip_text_encoder(16, 16, seed + 2), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(32, seed=seed + 3), tokenizer_3=t5_tokenizer())
    return pipe


def build_tiny_flux(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """A tiny random FLUX.1-dev-like folder (guidance embedded), latents [4, H/2, W/2].

    `scheduler`: the folder's scheduler (default FLUX's resolution-shifted FlowMatchEulerDiscreteScheduler).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=16, guidance_embeds=True,
                                         axes_dims_rope=(4, 2, 2)).eval()
    scheduler = scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                             max_shift=1.15, base_image_seq_len=16,
                                                             max_image_seq_len=256)
    pipe = FluxPipeline(scheduler=scheduler, vae=autoencoder_kl(scaling=0.36, shift=0.12, seed=seed),
                        text_encoder=clip_text_encoder(16, None, seed + 1), tokenizer=clip_tokenizer(),
                        text_encoder_2=t5_encoder(32, seed=seed + 2), tokenizer_2=t5_tokenizer(),
                        transformer=transformer)
    pipe.save_pretrained(str(folder))
    return Path(folder)


def build_tiny_wan(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """A tiny random Wan2.1 T2V folder: 8x spatial, 4x temporal VAE, latents [16, F', H/8, W/8].

    `scheduler`: the folder's scheduler (default FlowMatchEulerDiscreteScheduler(shift=3.0); the released
    Wan2.1 folders ship `wan_unipc_scheduler()`).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32,
                                        num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32).eval()
    pipe = WanPipeline(tokenizer=t5_tokenizer(), text_encoder=t5_encoder(32, umt5=True, seed=seed + 1), vae=vae,
                       scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)
    pipe.save_pretrained(str(folder))
    return Path(folder)


def wan_unipc_scheduler(flow_shift: float = 3.0):
    """Wan2.1's default scheduler, as its released diffusers folders configure it: UniPC (order 2, bh2)
    predicting flow velocity on flow sigmas shifted by `flow_shift` (3.0 at 480p, 5.0 at 720p)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True,
                                   final_sigmas_type="zero")


# ---------------------------------------------------------------------------
# A tiny stand-in folder of any card, for a smoke test (python -m engine.families.tiny)
# ---------------------------------------------------------------------------

# card id -> (module, builder): each builder writes a complete diffusers folder with save_pretrained.
TINY_BUILDERS = {
    "sd3": ("engine.families.tiny", "build_tiny_sd3"),
    "flux": ("engine.families.tiny", "build_tiny_flux"),
    "qwen-image": ("engine.families.tiny_qwen_image", "build_tiny_qwen_image"),
    "wan2.1-t2v": ("engine.families.tiny", "build_tiny_wan"),
    "wan2.1-i2v": ("engine.families.tiny_wan_i2v", "build_tiny_wan_i2v"),
    "ltx2": ("engine.families.tiny_ltx2", "build_tiny_ltx2"),
    "flux2-klein": ("engine.families.tiny_2026", "build_tiny_flux2_klein"),
    "z-image": ("engine.families.tiny_2026", "build_tiny_z_image"),
    "wan2.2-t2v": ("engine.families.tiny_2026", "build_tiny_wan22"),
    "flux-kontext": ("engine.families.tiny_edit", "build_tiny_flux_kontext"),
    "qwen-image-edit-plus": ("engine.families.tiny_edit", "build_tiny_qwen_image_edit_plus"),
}
# A size each tiny folder generates at, within its card's size rule (the sampling.* keys of a smoke run).
TINY_SIZES = {
    "sd3": dict(height=32, width=32),
    "flux": dict(height=32, width=32),
    "qwen-image": dict(height=24, width=40),
    "wan2.1-t2v": dict(height=16, width=16, frames=5),
    "wan2.1-i2v": dict(height=16, width=32, frames=5),
    "ltx2": dict(height=32, width=64, frames=5),
    "flux2-klein": dict(height=24, width=40),
    "z-image": dict(height=24, width=40),
    "wan2.2-t2v": dict(height=16, width=32, frames=5),
    "flux-kontext": dict(height=24, width=40),
    "qwen-image-edit-plus": dict(height=32, width=64),
}
# Cards whose prompts come with an image (a .jsonl of {"prompt": ..., "image": ...} rows).
IMAGE_CARDS = ("wan2.1-i2v", "flux-kontext", "qwen-image-edit-plus")
# Cards whose weights ship with the project: they need no folder.
SHIPPED_CARDS = ("toy-digits", "toy-numbers")


class TinyFolderError(ValueError):
    """A tiny folder cannot be written as asked (an unknown card, an output path in use)."""


def check_tiny_request(card: str, out: str | Path) -> Path:
    """The output folder of `write_tiny_folder(card, out)`, or TinyFolderError before anything is written."""
    if card not in TINY_BUILDERS:
        shipped = (f"; {card} ships its weights and needs no folder (leave model.path unset)"
                   if card in SHIPPED_CARDS else "")
        raise TinyFolderError(f"--card {card}: no tiny folder for this card{shipped}; valid cards: "
                              f"{', '.join(TINY_BUILDERS)}")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise TinyFolderError(f"--out {out}: is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise TinyFolderError(f"--out {out}: the folder is not empty; give a new or empty folder (nothing was "
                              "overwritten)")
    return out


def write_tiny_folder(card: str, out: str | Path, seed: int = 0) -> Path:
    """Write a tiny random diffusers folder of `card` at `out` (a new or empty folder) and return it.

    The folder is what a user's would be (model_index.json, the transformer,
    VAE, text encoders, tokenizers and scheduler, written with save_pretrained),
    so the card's loader and the stock pipeline's `from_pretrained` read it;
    nothing is downloaded (the tokenizers are built in memory). It is written
    beside `out` first and moved into place when complete, so an interrupted
    write leaves no half folder. Generate at `TINY_SIZES[card]`.
    """
    import importlib
    import shutil
    import tempfile

    out = check_tiny_request(card, out)
    module, builder = TINY_BUILDERS[card]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        getattr(importlib.import_module(module), builder)(staging / card, seed=seed)
        if out.is_dir():
            out.rmdir()  # empty (checked above); os.replace cannot move a folder onto it otherwise
        (staging / card).replace(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def smoke_command(card: str, folder: str | Path) -> str:
    """A one-step GRPO command line that trains a LoRA on the tiny folder of `card` (CPU, seconds)."""
    size = " ".join(f"sampling.{k}={v}" for k, v in TINY_SIZES[card].items())
    reward = "rewards=audio_loudness:1.0 sampling.audio=true" if card == "ltx2" else "rewards=jpeg_compressibility:1.0"
    data = ("data.prompts=PROMPTS.jsonl data.eval_prompts=PROMPTS.jsonl" if card in IMAGE_CARDS
            else "data.prompts=PROMPTS.txt data.eval_prompts=PROMPTS.txt")
    return (f"python trainers/grpo.py model.card={card} model.path={folder} run_dir=runs/smoke-{card} "
            f"steps=1 tracker=none {data} data.prompts_per_step=2 data.group_size=2 sampling.steps=2 "
            f"sampling.eval_steps=1 sampling.eval_seeds=1 {size} {reward} model.finetune=lora model.lora_rank=4")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m engine.families.tiny",
        description="Write a tiny random diffusers folder of a model card, for a smoke test (no download).")
    parser.add_argument("--card", required=True, help=f"one of: {', '.join(TINY_BUILDERS)}")
    parser.add_argument("--out", required=True, help="a new or empty folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    try:
        check_tiny_request(args.card, args.out)
        folder = write_tiny_folder(args.card, args.out, seed=args.seed)
    except ModuleNotFoundError as e:  # before OSError's branch: not a path problem
        print(f"error: the tiny {args.card} folder is built with diffusers and transformers ({e.name} is not "
              "installed): pip install -e \".[diffusers]\"", file=sys.stderr)
        return 2
    except (TinyFolderError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a tiny random {args.card} folder to {folder} (random weights: outputs are noise)")
    prompts = ("PROMPTS.jsonl: lines of {\"prompt\": ..., \"image\": \"frame.png\"} (a first frame or source "
               "image each)" if args.card in IMAGE_CARDS else "PROMPTS.txt: a few prompts, one a line")
    print(f"smoke test ({prompts}):\n  {smoke_command(args.card, folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
