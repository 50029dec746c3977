"""The `sd3` card: Stable Diffusion 3 / 3.5 through diffusers' SD3Transformer2DModel.

Prompts are embedded by the stock pipeline's own `encode_prompt` (CLIP-L,
CLIP-G and T5 joined as diffusers does), and the scheduler's config sets the
time shift (3.0 for SD3.5), so a rollout matches `StableDiffusion3Pipeline`.
ODE requests on a folder whose scheduler is not FlowMatchEulerDiscreteScheduler
step with that scheduler, set as the pipeline sets it (`ode_scheduler`).
"""

from __future__ import annotations

import torch

from engine.cards import PromptEmbeds
from engine.families.common import (DiffusersFlowModel, decode_image_latents, flow_time_to_batch, flux_shift_mu,
                                    folder_ode_scheduler, image_latent_shape, load_family, scheduler_flow_times)

CARD_ID = "sd3"
PIPELINE = "StableDiffusion3Pipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler",
              "text_encoder": "model", "tokenizer": "tokenizer", "text_encoder_2": "model",
              "tokenizer_2": "tokenizer", "text_encoder_3": "model", "tokenizer_3": "tokenizer"}


class SD3Model(DiffusersFlowModel):
    """FlowModel of SD3: latents [B, C, H/8, W/8] after the VAE's scaling and shift."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = 256):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer_3, max_sequence_length)
        self.vae_scale = pipe.vae_scale_factor
        self.patch = self.transformer.config.patch_size
        self.default_size = self.transformer.config.sample_size * self.vae_scale

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """The pipeline's joint CLIP + T5 embeddings (fp32); no mask (SD3 attends to padding)."""
        prompts = list(prompts)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=prompts, prompt_3=prompts, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.float(), pooled.float(), None)

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32); diffusers' timestep is t·1000."""
        timestep = flow_time_to_batch(t, latents.shape[0], latents.device) * 1000.0
        out = transformer(hidden_states=latents.to(self.dtype), timestep=timestep,
                          encoder_hidden_states=cond.embeds.to(self.dtype),
                          pooled_projections=cond.pooled.to(self.dtype), return_dict=False)[0]
        return out.float()

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The scheduler's shifted flow times (SD3.5: shift 3.0)."""
        return scheduler_flow_times(self.scheduler_config, steps, image_seq_len=self.tokens(latent_shape))

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler); a resolution shift only if it asks for one."""
        scheduler = self.pipe.scheduler
        mu = None
        if scheduler.config.get("use_dynamic_shifting", None):
            mu = flux_shift_mu(self.tokens(latent_shape), scheduler.config, default_max_shift=1.16)
        return folder_ode_scheduler(scheduler, steps, self.device, mu=mu)

    def tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Image tokens the transformer sees (patches of the latent)."""
        return (latent_shape[-2] // self.patch) * (latent_shape[-1] // self.patch)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to images [B, 3, H, W] in [0, 1] (fp32)."""
        return decode_image_latents(self.vae, latents)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(C, H/s, W/s); H and W default to the transformer's native size and must be multiples of s·patch."""
        return image_latent_shape(CARD_ID, height, width, frames, self.default_size, self.vae_scale,
                                  self.vae_scale * self.patch, self.transformer.config.in_channels)


def load_sd3(path, device: torch.device, dtype: torch.dtype) -> SD3Model:
    """Load SD3 / SD3.5 from a local diffusers folder (every component in `dtype`)."""
    return load_family(SD3Model, PIPELINE, COMPONENTS, path, device, dtype)
