"""The `wan2.1-t2v` card: Wan2.1 text-to-video through diffusers' WanTransformer3DModel.

Latents are [B, C, F', H/8, W/8] (F' = (F - 1)/4 + 1, the causal VAE's
temporal compression), normalised by the VAE's per-channel mean and std as
`WanPipeline` does; decoded videos are [B, 3, F, H, W] in [0, 1].

Rollouts (Flow-SDE / CPS) sample with the engine's own steps on the flow
times of the folder's shift (`shift`, or UniPC's `flow_shift`). ODE requests
(evaluation, serving) step with the folder's own scheduler when it is not
FlowMatchEulerDiscreteScheduler. Wan's default is UniPCMultistepScheduler,
whose final latents differ from Euler steps at the same shift by 0.1-0.3 (a
tiny Wan, 4-8 steps), so the engine steps with UniPC itself and equals
`WanPipeline` (`DiffusersFlowModel.ode_scheduler`, tested to 1e-5).
"""

from __future__ import annotations

import torch

from engine.cards import PromptEmbeds
from engine.families.common import (DiffusersFlowModel, flow_time_to_batch, load_family, scheduler_flow_times)

CARD_ID = "wan2.1-t2v"
PIPELINE = "WanPipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer"}


class WanModel(DiffusersFlowModel):
    """FlowModel of Wan2.1 T2V: video latents [B, C, F', H', W']."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = 512):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer, max_sequence_length)
        self.spatial_scale = pipe.vae_scale_factor_spatial
        self.temporal_scale = pipe.vae_scale_factor_temporal
        z = self.vae.config.z_dim
        self._mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
        self._std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """UMT5 embeddings zero-padded past each prompt (fp32); Wan has no pooled embedding (pooled is [B, 0])."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        embeds = embeds.float()
        return PromptEmbeds(embeds, embeds.new_zeros(embeds.shape[0], 0), None)

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32) of video latents; diffusers' timestep is t·1000."""
        timestep = flow_time_to_batch(t, latents.shape[0], latents.device) * 1000.0
        out = transformer(hidden_states=latents.to(self.dtype), timestep=timestep,
                          encoder_hidden_states=cond.embeds.to(self.dtype), return_dict=False)[0]
        return out.float()

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The scheduler config's shifted flow times (Wan2.1: shift 3.0 at 480p, 5.0 at 720p)."""
        return scheduler_flow_times(self.scheduler_config, steps)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to videos [B, 3, F, H, W] in [0, 1] (fp32)."""
        mean, std = self._mean.to(latents.device), self._std.to(latents.device)
        latents = latents.float() * std + mean
        video = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0.0, 1.0)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(C, (F-1)/4+1, H/8, W/8); F = 4k+1 frames, H and W multiples of 16 (default 480x832, 33 frames)."""
        height, width, frames = height or 480, width or 832, frames or 33
        step = self.spatial_scale * self.transformer.config.patch_size[1]
        if height % step or width % step:
            raise ValueError(f"{self.card_id}: height and width must be multiples of {step}; got {height}x{width}")
        if (frames - 1) % self.temporal_scale:
            raise ValueError(f"{self.card_id}: frames must be {self.temporal_scale}k+1 (e.g. 33, 81); got {frames}")
        return (self.vae.config.z_dim, (frames - 1) // self.temporal_scale + 1,
                height // self.spatial_scale, width // self.spatial_scale)


def load_wan(path, device: torch.device, dtype: torch.dtype) -> WanModel:
    """Load Wan2.1 T2V from a local diffusers folder (every component in `dtype`)."""
    return load_family(WanModel, PIPELINE, COMPONENTS, path, device, dtype)
