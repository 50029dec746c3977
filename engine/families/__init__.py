"""Real model families loaded from local diffusers folders (SD3, FLUX, Wan); each registers its card.

Registration is cheap: diffusers is imported only when a card's loader runs.
"""

from __future__ import annotations

from engine.cards import ModelCard, register_card


def _load_sd3(path, device, dtype):
    from engine.families.sd3 import load_sd3

    return load_sd3(path, device, dtype)


def _load_flux(path, device, dtype):
    from engine.families.flux import load_flux

    return load_flux(path, device, dtype)


def _load_wan(path, device, dtype):
    from engine.families.wan import load_wan

    return load_wan(path, device, dtype)


# The attention projections of the joint (MM-DiT) blocks: text and image streams.
MMDIT_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                      "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]

register_card(ModelCard(
    id="sd3",
    description="Stable Diffusion 3 / 3.5 (MM-DiT, CLIP-L + CLIP-G + T5-XXL) from a local diffusers folder.",
    load=_load_sd3,
    defaults=dict(steps=10, guidance_scale=4.5, noise_level=0.7, height=512, width=512,
                  lora_targets=MMDIT_LORA_TARGETS, diffusers_pipeline="StableDiffusion3Pipeline", video=False),
))
register_card(ModelCard(
    id="flux",
    description="FLUX.1 (guidance-distilled: guidance is an embedding, no unconditional branch) from a local "
                "diffusers folder.",
    load=_load_flux,
    defaults=dict(steps=10, guidance_scale=3.5, noise_level=0.7, height=512, width=512,
                  lora_targets=MMDIT_LORA_TARGETS, diffusers_pipeline="FluxPipeline", video=False),
))
register_card(ModelCard(
    id="wan2.1-t2v",
    description="Wan2.1 text-to-video (UMT5 + 3D DiT + causal video VAE) from a local diffusers folder; "
                "outputs videos [B, C, F, H, W].",
    load=_load_wan,
    defaults=dict(steps=10, guidance_scale=5.0, noise_level=0.7, height=480, width=832, frames=33,
                  lora_targets=["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"],
                  diffusers_pipeline="WanPipeline", video=True),
))
import engine.families.qwen_image  # noqa: F401,E402  (registers its card)
import engine.families.wan_i2v  # noqa: F401,E402  (registers its card)
import engine.families.ltx2  # noqa: F401,E402  (registers its card)
import engine.families.flux2_klein  # noqa: F401,E402  (registers its card)
import engine.families.z_image  # noqa: F401,E402  (registers its card)
import engine.families.wan22  # noqa: F401,E402  (registers its card)
import engine.families.flux_kontext  # noqa: F401,E402  (registers its card)
import engine.families.qwen_image_edit  # noqa: F401,E402  (registers its card)
