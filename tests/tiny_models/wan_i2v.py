"""A tiny random Wan2.1 image-to-video folder, built from configs (tests; nothing from a hub).

The same shape of pipeline as Wan-AI's Wan2.1-I2V-14B-*-Diffusers folders,
shrunk: a one-layer WanTransformer3DModel of width 24 with the image
cross-attention (`image_dim`, `added_kv_proj_dim`) and 16 + 4 + 16 input
channels (noise latents, the first-frame mask, the first-frame latents); a
two-layer CLIP vision tower on 16x16 crops (5 tokens); the 16-channel causal
video VAE (8x spatial, 4x temporal); a character-level UMT5. Two facts of the
released folders are kept because the transformer depends on them: the text
context is 512 tokens (WanAttnProcessor splits image from text tokens at
512), and the scheduler is Wan2.1's UniPC (flow sigmas, flow_shift 3.0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models.core import t5_encoder, t5_tokenizer, wan_unipc_scheduler

WAN_TEXT_TOKENS = 512  # the text context length diffusers' Wan cross-attention assumes
CLIP_CROP = 16  # the tiny CLIP vision tower's input size (real: 224)


def clip_vision_tower(hidden: int = 16, seed: int = 0):
    """A two-layer CLIP vision transformer: hidden_states[-2] (what Wan reads) is the first layer's output."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=hidden,
                              num_hidden_layers=2, num_attention_heads=2, image_size=CLIP_CROP, patch_size=8)
    return CLIPVisionModel(config).eval()


def clip_image_processor():
    """CLIP's preprocessing at the tiny tower's size (PIL backend: no torchvision needed)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": CLIP_CROP},
                                 crop_size={"height": CLIP_CROP, "width": CLIP_CROP})


def tiny_wan_i2v_pipeline(seed: int = 0, scheduler=None):
    """The WanImageToVideoPipeline of `build_tiny_wan_i2v`, in memory (random weights from `seed`)."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    heads, head_dim, image_dim = 2, 12, 16
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
        in_channels=16 + 4 + 16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        image_dim=image_dim, added_kv_proj_dim=heads * head_dim).eval()
    tokenizer = t5_tokenizer()
    tokenizer.model_max_length = WAN_TEXT_TOKENS
    return WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=t5_encoder(32, umt5=True, seed=seed + 1), vae=vae,
        scheduler=scheduler or wan_unipc_scheduler(), image_processor=clip_image_processor(),
        image_encoder=clip_vision_tower(image_dim, seed + 2), transformer=transformer)


def build_tiny_wan_i2v(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """Write the tiny Wan2.1 I2V folder with `save_pretrained`; latents [16, F', H/8, W/8].

    `scheduler`: the folder's scheduler (default Wan2.1's UniPC, as the released folders ship).
    """
    tiny_wan_i2v_pipeline(seed, scheduler).save_pretrained(str(folder))
    return Path(folder)
