"""The `qwen-image` card: Qwen-Image through diffusers' QwenImageTransformer2DModel.

Conventions read from diffusers 0.42.1's `QwenImagePipeline` and followed here:

- Prompts go through the pipeline's own `encode_prompt`: a Qwen2.5-VL chat
  template around the prompt, the last hidden state of the VLM's text model,
  the template's first 34 tokens dropped, each prompt zero-padded to the
  batch's longest with a mask. The engine caches prompts one by one and joins
  the CFG branches and trajectories of different batches, so every prompt is
  padded further to one fixed length, `max_sequence_length` (256, as
  verl-omni's Qwen-Image OCR run sets it), and the mask rides along in
  `PromptEmbeds.mask`. Padded text tokens are masked out of the joint
  attention and the text RoPE counts positions from the start, so the padding
  changes nothing but float rounding (tested against the pipeline, which pads
  each branch to its own length). Longer prompts are truncated there, as the
  pipeline truncates at its `max_sequence_length`.
- CFG is the pipeline's "true CFG": the negative prompt's branch, then
  comb = v_u + g·(v_c - v_u) rescaled to the conditional velocity's norm,
  comb·‖v_c‖/‖comb‖, the norm taken over each packed token's 4C values (the
  C latent channels of one 2x2 patch: the pipeline's last dimension), not over
  the channels alone (`guide`). The engine's `guidance_scale` is the
  pipeline's `true_cfg_scale`; the pipeline's `guidance_scale` is for
  guidance-distilled checkpoints (a transformer with `guidance_embeds`) and
  Qwen-Image has none: such a folder is refused. As in the pipeline, CFG is
  on only for a scale > 1 (at or below 1 the result is the conditional
  velocity; the engine skips the second branch at exactly 1).
- The transformer reads time as sigma (the scheduler's timestep / 1000, not
  t·1000) and the packed 2x2 patches with `img_shapes` [(1, H'/2, W'/2)].
- Flow times: the scheduler's own sigmas for the pipeline's grid
  linspace(1, 1/T, T), shifted by resolution (mu from the packed token count,
  the pipeline's `calculate_shift` with the scheduler config's anchors); the
  released config uses the exponential time shift and a terminal sigma of 0.02.
- Latents stay unpacked as [B, C, H/8, W/8] in the engine: Qwen's VAE is a
  video VAE and the pipeline's own latents are [B, C, 1, H', W'] before
  packing, but the frame axis of 1 carries nothing, image rewards and grids
  expect 4-D image latents, and packing the 4-D tensor gives the pipeline's
  packed sequence bit for bit (same memory order). `decode` adds the frame
  axis back and undoes the VAE's per-channel mean/std normalisation.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families import MMDIT_LORA_TARGETS
from engine.families.common import (DiffusersFlowModel, flow_time_to_batch, flux_shift_mu, folder_ode_scheduler,
                                    image_latent_shape, load_family, scheduler_flow_times)
from engine.families.flux import pack_latents, unpack_latents

CARD_ID = "qwen-image"
PIPELINE = "QwenImagePipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer"}
# Text tokens every prompt is padded (or truncated) to: verl-omni's Qwen-Image OCR setting. The pipeline's
# default is 512; padding costs attention over masked tokens, so the shorter bound that fits OCR prompts.
TEXT_TOKENS = 256


def true_cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG on packed velocities [B, N, D]: the guided velocity rescaled, token by
    token, to the norm of the conditional one (norms over the last dimension)."""
    comb = v_uncond + scale * (v_cond - v_uncond)
    cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)


class QwenImageModel(DiffusersFlowModel):
    """FlowModel of Qwen-Image: latents unpacked [B, C, H/8, W/8], true CFG with its norm rescale."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = TEXT_TOKENS):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer, max_sequence_length)
        if self.transformer.config.guidance_embeds:
            raise ValueError(f"{CARD_ID}: this folder's transformer is guidance-distilled (guidance_embeds=true); "
                             f"the card runs Qwen-Image's true CFG and has no embedded-guidance path")
        self.vae_scale = pipe.vae_scale_factor
        self.default_size = pipe.default_sample_size * self.vae_scale
        z = self.vae.config.z_dim
        self._mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
        self._inv_std = 1.0 / torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """The pipeline's VLM embeddings (fp32), zero-padded to `max_sequence_length` tokens, with their mask
        (bool, True = a prompt token); Qwen-Image has no pooled embedding (pooled is [B, 0])."""
        length = self.max_sequence_length
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, max_sequence_length=length)
        b, n, d = embeds.shape
        # encode_prompt returns no mask when no prompt of the batch was padded: every token is real.
        mask = torch.ones(b, n, dtype=torch.bool, device=embeds.device) if mask is None else mask.bool()
        padded = embeds.new_zeros(b, length, d, dtype=torch.float32)
        padded[:, :n] = embeds.float()
        full_mask = torch.zeros(b, length, dtype=torch.bool, device=embeds.device)
        full_mask[:, :n] = mask
        return PromptEmbeds(padded, padded.new_zeros(b, 0), full_mask)

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32) of unpacked latents; the transformer reads sigma (t·1000/1000 as the pipeline
        computes it from its timesteps, so the timestep embedding sees the same bits)."""
        b, c, h, w = latents.shape
        timestep = flow_time_to_batch(t, b, latents.device) * 1000.0 / 1000.0
        out = transformer(hidden_states=pack_latents(latents).to(self.dtype), timestep=timestep,
                          encoder_hidden_states=cond.embeds.to(self.dtype), encoder_hidden_states_mask=cond.mask,
                          img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return unpack_latents(out.float(), c, h, w)

    def guide(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """True CFG with the norm rescale, on the packed tokens as the pipeline computes it; a scale <= 1 is
        the conditional velocity (the pipeline turns CFG on only above 1)."""
        if guidance_scale <= 1.0:
            return v_cond
        _, c, h, w = v_cond.shape
        return unpack_latents(true_cfg(pack_latents(v_uncond), pack_latents(v_cond), guidance_scale), c, h, w)

    def tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Packed image tokens (2x2 latent patches): the sequence length the shift is computed from."""
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The scheduler's sigmas for the pipeline's grid linspace(1, 1/T, T), shifted by resolution."""
        times = scheduler_flow_times(self.scheduler_config, steps, image_seq_len=self.tokens(latent_shape),
                                     flux_sigmas=True)
        if not torch.isfinite(times).all():  # host-side, before any denoising
            raise ValueError(f"{CARD_ID}: the folder's scheduler gives non-finite flow times for steps={steps} "
                             f"(shift_terminal={self.scheduler_config.get('shift_terminal')} stretches a one-step "
                             f"grid by 0/0, in the stock pipeline too); use steps >= 2")
        return times

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler), set as QwenImagePipeline sets it: its
        sigma grid unless the scheduler makes flow sigmas itself, and the resolution shift mu."""
        scheduler = self.pipe.scheduler
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = flux_shift_mu(self.tokens(latent_shape), scheduler.config)
        return folder_ode_scheduler(scheduler, steps, self.device, sigmas=sigmas, mu=mu)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, H', W'] to images [B, 3, H, W] in [0, 1] (fp32), through the video VAE's single frame."""
        mean, inv_std = self._mean.to(latents.device), self._inv_std.to(latents.device)
        video = latents.float().unsqueeze(2) / inv_std + mean  # the pipeline's order: x / (1 / std) + mean
        images = self.vae.decode(video.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0.0, 1.0)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(C, H/s, W/s); H and W multiples of 2s (the 2x2 packing), default the pipeline's 1024 (tiny: 256)."""
        return image_latent_shape(CARD_ID, height, width, frames, self.default_size, self.vae_scale,
                                  self.vae_scale * 2, self.transformer.config.in_channels // 4)


def load_qwen_image(path, device: torch.device, dtype: torch.dtype) -> QwenImageModel:
    """Load Qwen-Image from a local diffusers folder (every component in `dtype`)."""
    return load_family(QwenImageModel, PIPELINE, COMPONENTS, path, device, dtype)


# Registration stays cheap: the loader above imports diffusers only when it runs.
register_card(ModelCard(
    id=CARD_ID,
    description="Qwen-Image (MM-DiT, Qwen2.5-VL text encoder, true CFG with its norm rescale) from a local "
                "diffusers folder.",
    load=load_qwen_image,
    # Flow-GRPO's and verl-omni's Qwen-Image rollouts: 10 steps, CFG 4 (true_cfg_scale), noise level 1.2, 512px.
    defaults=dict(steps=10, guidance_scale=4.0, noise_level=1.2, height=512, width=512,
                  lora_targets=MMDIT_LORA_TARGETS, diffusers_pipeline=PIPELINE, video=False),
))
