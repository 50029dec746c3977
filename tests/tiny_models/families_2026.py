"""Tiny random folders of the 2026 families (FLUX.2-klein, Z-Image, Wan2.2 T2V), built from configs.

Every component is the class the stock pipeline loads, shrunk until a test
runs in seconds on a CPU; nothing comes from a hub (tokenizers are built in
memory). Two facts of the released folders are kept because the pipelines
depend on them:

- FLUX.2-klein reads the Qwen3 text encoder's hidden states 9, 18 and 27, so
  its tiny Qwen3 has 27 layers (of width 16); Z-Image reads the penultimate
  hidden state of a Qwen3 base model.
- Both tokenizers carry a chat template (`apply_chat_template` with
  `enable_thinking`), as Qwen3's does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models.core import t5_encoder, t5_tokenizer, wan_unipc_scheduler
from tiny_models.qwen_image import qwen2_tokenizer

QWEN3_WIDTH = 16
# A Qwen3-like chat template: the user turn, the assistant's opening, and the empty thinking block that
# Qwen3 writes when thinking is off.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def qwen3_tokenizer():
    """The byte-level Qwen2 BPE of the tiny Qwen-Image folder with a Qwen3-like chat template."""
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen3_text_encoder(vocab_size: int, layers: int, causal_lm: bool, seed: int = 0):
    """A Qwen3 of width QWEN3_WIDTH (2 heads of 8, one key/value head); Qwen3ForCausalLM or the base model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=QWEN3_WIDTH, intermediate_size=2 * QWEN3_WIDTH,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, pad_token_id=vocab_size - 3, bos_token_id=vocab_size - 3,
                         eos_token_id=vocab_size - 1)
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()


# ---- FLUX.2-klein --------------------------------------------------------------------------------

FLUX2_LATENT_CHANNELS = 4  # the VAE's channels; the transformer reads 2x2 patches of them (16)


def flux2_vae(seed: int = 0):
    """AutoencoderKLFlux2 at 2x (two blocks of width 8), with non-trivial batch-norm statistics of the
    patchified latents, so a decode that skips the de-normalisation is caught."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                             latent_channels=FLUX2_LATENT_CHANNELS, norm_num_groups=4, sample_size=32,
                             mid_block_add_attention=False).eval()
    channels = vae.bn.running_mean.numel()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    return vae


def tiny_flux2_klein_pipeline(seed: int = 0, scheduler=None, is_distilled: bool = False):
    """The Flux2KleinPipeline of `build_tiny_flux2_klein`, in memory (random weights from `seed`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    tokenizer = qwen3_tokenizer()
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=4 * FLUX2_LATENT_CHANNELS, num_layers=1,
                                          num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * QWEN3_WIDTH, timestep_guidance_channels=32,
                                          mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False).eval()
    # FLUX.2's released scheduler: resolution-dependent shift (mu from the pipeline's empirical fit).
    scheduler = scheduler or FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                             use_dynamic_shifting=True, time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=flux2_vae(seed),
                              text_encoder=qwen3_text_encoder(len(tokenizer), 27, True, seed + 1),
                              tokenizer=tokenizer, transformer=transformer, is_distilled=is_distilled)


def build_tiny_flux2_klein(folder: str | Path, seed: int = 0, scheduler=None, is_distilled: bool = False) -> Path:
    """A tiny random FLUX.2-klein folder: latents [16, H/4, W/4] (2x2 patches of a 2x VAE's 4 channels)."""
    tiny_flux2_klein_pipeline(seed, scheduler, is_distilled).save_pretrained(str(folder))
    return Path(folder)


# ---- Z-Image -------------------------------------------------------------------------------------

def tiny_z_image_pipeline(seed: int = 0, scheduler=None):
    """The ZImagePipeline of `build_tiny_z_image`, in memory (random weights from `seed`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from tiny_models.core import autoencoder_kl

    tokenizer = qwen3_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2,
                                           n_kv_heads=2, cap_feat_dim=QWEN3_WIDTH, axes_dims=[4, 6, 6],
                                           axes_lens=[1024, 64, 64]).eval()
    # Z-Image-Turbo's released scheduler: a static shift of 3 (the pipeline's mu is then unused).
    scheduler = scheduler or FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return ZImagePipeline(scheduler=scheduler, vae=autoencoder_kl(scaling=0.36, shift=0.12, seed=seed),
                          text_encoder=qwen3_text_encoder(len(tokenizer), 2, False, seed + 1), tokenizer=tokenizer,
                          transformer=transformer)


def build_tiny_z_image(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """A tiny random Z-Image folder: latents [4, H/2, W/2], a one-block single-stream transformer of width 32."""
    tiny_z_image_pipeline(seed, scheduler).save_pretrained(str(folder))
    return Path(folder)


# ---- Wan2.2 T2V (two experts) --------------------------------------------------------------------

def tiny_wan_transformer(seed: int, num_layers: int = 1, heads: int = 2, head_dim: int = 12):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=2 * heads * head_dim,
                                 num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32).eval()


def tiny_wan22_pipeline(seed: int = 0, scheduler=None, boundary_ratio: float = 0.875, num_layers: int = 1,
                        heads: int = 2, head_dim: int = 12):
    """The two-expert WanPipeline of `build_tiny_wan22`: `transformer` (high noise) and `transformer_2`
    (low noise), different random weights, switching at `boundary_ratio` (Wan2.2 T2V-A14B's 0.875). The
    experts' depth and width (heads·head_dim, head_dim a multiple of 6 for the 3-axis rotary) are for
    benchmarks."""
    from diffusers import AutoencoderKLWan, WanPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    tokenizer = t5_tokenizer()
    tokenizer.model_max_length = 512  # as the released folders' UMT5 tokenizers declare: the pipeline's length
    return WanPipeline(tokenizer=tokenizer, text_encoder=t5_encoder(32, umt5=True, seed=seed + 1), vae=vae,
                       scheduler=scheduler or wan_unipc_scheduler(flow_shift=12.0),
                       transformer=tiny_wan_transformer(seed + 2, num_layers, heads, head_dim),
                       transformer_2=tiny_wan_transformer(seed + 3, num_layers, heads, head_dim),
                       boundary_ratio=boundary_ratio)


def build_tiny_wan22(folder: str | Path, seed: int = 0, scheduler=None, boundary_ratio: float = 0.875) -> Path:
    """A tiny random Wan2.2 T2V-A14B-like folder (UniPC, flow_shift 12): latents [16, F', H/8, W/8]."""
    tiny_wan22_pipeline(seed, scheduler, boundary_ratio).save_pretrained(str(folder))
    return Path(folder)
