"""The `flux` card: FLUX.1 through diffusers' FluxTransformer2DModel.

FLUX.1-dev is guidance-distilled: the guidance scale is an input embedding and
there is no unconditional branch (`embedded_guidance = True`). The engine keeps
latents unpacked [B, C, H/8, W/8]; they are packed into 2x2 patches (the
sequence FLUX's transformer reads) only inside `velocity`. ODE requests on a
folder whose scheduler is not FlowMatchEulerDiscreteScheduler step with that
scheduler, set as `FluxPipeline` sets it (`ode_scheduler`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cards import PromptEmbeds
from engine.families.common import (DiffusersFlowModel, decode_image_latents, flow_time_to_batch, flux_shift_mu,
                                    folder_ode_scheduler, image_latent_shape, load_family, scheduler_flow_times)

CARD_ID = "flux"
PIPELINE = "FluxPipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer", "text_encoder_2": "model", "tokenizer_2": "tokenizer"}


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2x2 patches as tokens (FLUX's layout)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_latents`."""
    b = tokens.shape[0]
    x = tokens.reshape(b, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, height, width)


class FluxModel(DiffusersFlowModel):
    """FlowModel of FLUX.1: guidance embedded, latents unpacked [B, C, H/8, W/8]."""

    card_id = CARD_ID
    embedded_guidance = True

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = 512):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer_2, max_sequence_length)
        self.vae_scale = pipe.vae_scale_factor
        self.default_size = pipe.default_sample_size * self.vae_scale
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self._image_ids: dict[tuple, torch.Tensor] = {}

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """The pipeline's T5 sequence and CLIP pooled embedding (fp32); no mask."""
        prompts = list(prompts)
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=prompts, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(embeds.float(), pooled.float(), None)

    def image_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Positions of the packed tokens (built once per size, so the loop makes no transfers)."""
        key = (h, w, str(device))
        if key not in self._image_ids:
            ids = torch.zeros(h // 2, w // 2, 3)
            ids[..., 1] = torch.arange(h // 2)[:, None]
            ids[..., 2] = torch.arange(w // 2)[None, :]
            self._image_ids[key] = ids.reshape(-1, 3).to(device=device, dtype=self.dtype)
        return self._image_ids[key]

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds,
                 guidance: float | None = None) -> torch.Tensor:
        """Velocity (fp32) of unpacked latents; `guidance` is the embedded guidance scale."""
        b, c, h, w = latents.shape
        # t·1000/1000 as the pipeline computes it, so the timestep embedding sees identical bits.
        timestep = flow_time_to_batch(t, b, latents.device) * 1000.0 / 1000.0
        g = None
        if self.guidance_embeds:
            g = torch.full((b,), 1.0 if guidance is None else float(guidance), dtype=torch.float32,
                           device=latents.device)
        text_ids = torch.zeros(cond.embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        out = transformer(hidden_states=pack_latents(latents).to(self.dtype), timestep=timestep, guidance=g,
                          pooled_projections=cond.pooled.to(self.dtype),
                          encoder_hidden_states=cond.embeds.to(self.dtype), txt_ids=text_ids,
                          img_ids=self.image_ids(h, w, latents.device), return_dict=False)[0]
        return unpack_latents(out.float(), c, h, w)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """FLUX's resolution-dependent shifted flow times."""
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        return scheduler_flow_times(self.scheduler_config, steps, image_seq_len=tokens, flux_sigmas=True)

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler), set as FluxPipeline sets it:
        its sigma grid linspace(1, 1/T) unless the scheduler makes flow sigmas itself, and always the
        resolution shift mu."""
        scheduler = self.pipe.scheduler
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = flux_shift_mu((latent_shape[-2] // 2) * (latent_shape[-1] // 2), scheduler.config)
        return folder_ode_scheduler(scheduler, steps, self.device, sigmas=sigmas, mu=mu)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to images [B, 3, H, W] in [0, 1] (fp32)."""
        return decode_image_latents(self.vae, latents)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(C, H/s, W/s), H and W multiples of 2s (the packing needs even latent sizes)."""
        return image_latent_shape(CARD_ID, height, width, frames, self.default_size, self.vae_scale,
                                  self.vae_scale * 2, self.transformer.config.in_channels // 4)


def load_flux(path, device: torch.device, dtype: torch.dtype) -> FluxModel:
    """Load FLUX.1 from a local diffusers folder (every component in `dtype`)."""
    return load_family(FluxModel, PIPELINE, COMPONENTS, path, device, dtype)
