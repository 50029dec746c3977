"""The shared parts of the tiny folders (tokenizers, text encoders, a KL VAE) and tiny SD3, FLUX.1 and Wan2.1.

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

