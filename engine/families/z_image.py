"""The `z-image` card: Z-Image through diffusers' ZImageTransformer2DModel (`ZImagePipeline`).

Conventions read from diffusers 0.42.1's `ZImagePipeline` and followed here:

- Prompts: the Qwen3 chat template (thinking on, as the pipeline writes it),
  padded to 512 tokens for the encoder; the penultimate hidden state, with
  the padding dropped: the transformer takes one variable-length caption per
  sample (a list). The engine caches prompts one by one and batches CFG
  branches, so each prompt is kept zero-padded to 512 with its mask in
  `PromptEmbeds.mask`, and `velocity` hands the transformer each row's real
  tokens only (a boolean index: one host read per forward, as the pipeline's
  own list-building makes).
- Latents: [B, C, H/s, W/s] as the VAE's (scaling and shift factors), one
  frame per sample for the transformer ([C, 1, H', W'] list entries).
- Time: the transformer reads 1 - sigma ((1000 - timestep) / 1000), and its
  output is the negated velocity: the card returns `-out`.
- Flow times: the scheduler's sigmas for the grid torch.linspace(1, 1/T, T)
  with mu from the packed token count (`calculate_shift`; used only by a
  scheduler with dynamic shifting: Z-Image-Turbo's has a static shift of 3).
- CFG: the pipeline writes pos + s·(pos - neg) and turns it on for s > 0.
  The engine's guidance_scale g keeps the convention of every other card
  (g = 1 is no guidance; g = v_u + g·(v_c - v_u)), so g = s + 1: the
  pipeline's guidance_scale=4 is the engine's 5, and Turbo's 0 is the
  engine's 1. `guide` computes the pipeline's own expression with s = g - 1.
  The pipeline's `cfg_normalization` and `cfg_truncation` are left at their
  defaults (off); the card does not expose them.
"""

from __future__ import annotations

import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families.common import (DiffusersFlowModel, decode_image_latents, flow_time_to_batch,
                                    folder_ode_scheduler, image_latent_shape, load_family)

CARD_ID = "z-image"
PIPELINE = "ZImagePipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer"}
TEXT_TOKENS = 512  # the pipeline's max_sequence_length
# Attention and feed-forward of the main single-stream layers (the refiners stay frozen).
LORA_TARGETS = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


class ZImageModel(DiffusersFlowModel):
    """FlowModel of Z-Image: latents [B, C, H/s, W/s], variable-length captions, CFG as pos + (g-1)(pos - neg)."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = TEXT_TOKENS):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer, max_sequence_length)
        self.vae_scale = pipe.vae_scale_factor

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Each prompt's real tokens (fp32), zero-padded to `max_sequence_length` with their mask (True = a
        token the transformer sees); no pooled embedding ([B, 0])."""
        rows = self.pipe._encode_prompt(prompt=list(prompts), device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        length, width = self.max_sequence_length, rows[0].shape[-1]
        embeds = torch.zeros(len(rows), length, width, dtype=torch.float32, device=self.device)
        mask = torch.zeros(len(rows), length, dtype=torch.bool, device=self.device)
        for i, row in enumerate(rows):
            embeds[i, :row.shape[0]] = row.float()
            mask[i, :row.shape[0]] = True
        return PromptEmbeds(embeds, embeds.new_zeros(len(rows), 0), mask)

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32): the negated transformer output at time 1 - sigma, on each row's real caption tokens."""
        if cond.mask is None:
            raise ValueError(f"{CARD_ID}: the prompt embeddings carry no mask (encode them with this card's "
                             f"encode_prompts)")
        b = latents.shape[0]
        timestep = (1000.0 - flow_time_to_batch(t, b, latents.device) * 1000.0) / 1000.0
        embeds = cond.embeds.to(self.dtype)
        captions = [embeds[i][cond.mask[i]] for i in range(b)]
        frames = list(latents.to(self.dtype).unsqueeze(2).unbind(dim=0))
        out = transformer(frames, timestep, captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def guide(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The pipeline's CFG, pos + s·(pos - neg) with s = g - 1 (on negated velocities: negation is exact)."""
        return v_cond + (guidance_scale - 1.0) * (v_cond - v_uncond)

    def tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Image tokens (2x2 latent patches): the sequence length mu is computed from."""
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def pipeline_grid(self, config, steps: int, latent_shape: tuple[int, ...]) -> tuple[list[float], float]:
        """(sigmas, mu) the pipeline passes to `set_timesteps`: torch.linspace(1, 1/T, T) and calculate_shift."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        mu = calculate_shift(self.tokens(latent_shape), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return torch.linspace(1.0, 1 / steps, steps).tolist(), mu

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The Euler scheduler's sigmas for the pipeline's grid (its shift, static or by resolution)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = {k: v for k, v in self.scheduler_config.items() if not k.startswith("_")}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        sigmas, mu = self.pipeline_grid(scheduler.config, steps, latent_shape)
        scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(torch.float32)

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler), set as ZImagePipeline sets it."""
        sigmas, mu = self.pipeline_grid(self.pipe.scheduler.config, steps, latent_shape)
        return folder_ode_scheduler(self.pipe.scheduler, steps, self.device, sigmas=sigmas, mu=mu)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to images [B, 3, H, W] in [0, 1] (fp32)."""
        return decode_image_latents(self.vae, latents)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(C, H/s, W/s); H and W multiples of 2s (the 2x2 patches), default the pipeline's 1024."""
        return image_latent_shape(CARD_ID, height, width, frames, 1024, self.vae_scale, self.vae_scale * 2,
                                  self.transformer.config.in_channels)


def load_z_image(path, device: torch.device, dtype: torch.dtype) -> ZImageModel:
    """Load Z-Image from a local diffusers folder (every component in `dtype`)."""
    return load_family(ZImageModel, PIPELINE, COMPONENTS, path, device, dtype)


register_card(ModelCard(
    id=CARD_ID,
    description="Z-Image (single-stream DiT, Qwen3 text encoder, variable-length captions) from a local "
                "diffusers folder; guidance_scale g is the pipeline's g - 1.",
    load=load_z_image,
    # Z-Image-Turbo: 8 steps (9 sigmas), no CFG (the pipeline's guidance 0 = the engine's 1).
    defaults=dict(steps=8, guidance_scale=1.0, noise_level=0.7, height=512, width=512,
                  lora_targets=LORA_TARGETS, diffusers_pipeline=PIPELINE, video=False),
))
