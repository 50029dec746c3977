"""The `flux2-klein` card: FLUX.2 [klein] through diffusers' Flux2Transformer2DModel (`Flux2KleinPipeline`).

Conventions read from diffusers 0.42.1's `Flux2KleinPipeline` and followed here:

- Prompts: the Qwen3 chat template around each prompt (thinking off), padded
  to 512 tokens; the hidden states of layers 9, 18 and 27 are stacked on the
  feature axis (3 x the encoder's width). The transformer attends to every one
  of the 512 tokens (the pipeline passes no mask to it), so the embeddings
  carry no mask. Text positions are (0, 0, 0, l).
- Latents: the engine's latent is the pipeline's own noise space,
  [B, 4C, H/(2s), W/(2s)]: the VAE's C channels in 2x2 patches, normalised by
  the VAE's batch-norm statistics. The transformer reads it as a sequence of
  h·w tokens (row-major) with positions (0, y, x, 0); `decode` undoes the
  normalisation and the patches before the VAE.
- Time: the transformer reads sigma (the scheduler's timestep / 1000).
- Flow times: the scheduler's sigmas for the grid linspace(1, 1/T, T) (unless
  the scheduler makes flow sigmas itself), shifted by the pipeline's empirical
  mu, a fit in the token count and the number of steps (`empirical_mu`).
- CFG: the plain v_u + g·(v_c - v_u), on only for g > 1, with an empty
  negative prompt in the pipeline (the engine takes the request's negative
  prompt, "" by default). A step-distilled folder (`is_distilled`: klein 4B /
  9B) has no unconditional branch: the pipeline ignores its guidance scale
  with a warning; the card refuses a guidance scale other than 1 there instead
  of ignoring it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families.common import (DiffusersFlowModel, flow_time_to_batch, folder_ode_scheduler,
                                    image_latent_shape, load_family)

CARD_ID = "flux2-klein"
PIPELINE = "Flux2KleinPipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer"}
TEXT_TOKENS = 512  # the pipeline's max_sequence_length: every prompt is padded to it
# The joint (double-stream) blocks' attention on both streams, and the single-stream blocks' fused QKV+MLP
# input projection. (Their output projection is `attn.to_out`, a name that also ends the double-stream
# blocks' to_out ModuleList, which peft cannot adapt: it is left out.)
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj"]


def empirical_mu(image_seq_len: int, steps: int) -> float:
    """Flux2KleinPipeline's time shift: linear in the token count, interpolated in the number of steps
    between fits at 10 and 200 steps (above 4300 tokens the 200-step fit alone)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def latent_positions(h: int, w: int, device: torch.device) -> torch.Tensor:
    """(T, Y, X, L) of the h·w image tokens, row-major (the pipeline's `_prepare_latent_ids`), int64 [1, h·w, 4]."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).unsqueeze(0).to(device)


class Flux2KleinModel(DiffusersFlowModel):
    """FlowModel of FLUX.2-klein: latents [B, 4C, H/(2s), W/(2s)] (normalised 2x2 patches)."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = TEXT_TOKENS):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer, max_sequence_length)
        if self.transformer.config.guidance_embeds:
            raise ValueError(f"{CARD_ID}: this folder's transformer embeds guidance (guidance_embeds=true, "
                             f"FLUX.2 [dev]); the klein card runs CFG or a distilled model, not embedded guidance")
        self.distilled = bool(pipe.config.is_distilled)
        # A distilled folder has no unconditional branch: the engine then calls velocity(..., guidance=g).
        self.embedded_guidance = self.distilled
        self.vae_scale = pipe.vae_scale_factor
        self.default_size = pipe.default_sample_size * self.vae_scale
        self._positions: dict[tuple, torch.Tensor] = {}

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """The pipeline's stacked Qwen3 hidden states [B, 512, 3D] (fp32); no mask, no pooled ([B, 0])."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        embeds = embeds.float()
        return PromptEmbeds(embeds, embeds.new_zeros(embeds.shape[0], 0), None)

    def positions(self, h: int, w: int, text_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Image and text position ids (built once per size, so the loop makes no transfers)."""
        key = (h, w, text_len, str(device))
        if key not in self._positions:
            text = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text_len))
            self._positions[key] = (latent_positions(h, w, device), text.unsqueeze(0).to(device))
        return self._positions[key]

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds,
                 guidance: float | None = None) -> torch.Tensor:
        """Velocity (fp32) of latents [B, 4C, h, w]; the transformer reads sigma (t·1000/1000, the pipeline's
        arithmetic on its timesteps)."""
        if guidance is not None and guidance != 1.0:
            raise ValueError(f"{CARD_ID}: this folder is step-distilled (is_distilled=true in model_index.json): it "
                             f"has no unconditional branch and guidance_scale={guidance} would be ignored (the stock "
                             f"pipeline ignores it too); use guidance_scale=1")
        b, c, h, w = latents.shape
        timestep = flow_time_to_batch(t, b, latents.device) * 1000.0 / 1000.0
        image_ids, text_ids = self.positions(h, w, cond.embeds.shape[1], latents.device)
        tokens = latents.reshape(b, c, h * w).permute(0, 2, 1)
        out = transformer(hidden_states=tokens.to(self.dtype), timestep=timestep, guidance=None,
                          encoder_hidden_states=cond.embeds.to(self.dtype), txt_ids=text_ids.expand(b, -1, -1),
                          img_ids=image_ids.expand(b, -1, -1), return_dict=False)[0]
        return out.float().permute(0, 2, 1).reshape(b, c, h, w)

    def tokens(self, latent_shape: tuple[int, ...]) -> int:
        return latent_shape[-2] * latent_shape[-1]

    def pipeline_grid(self, scheduler, steps: int, latent_shape: tuple[int, ...]):
        """(sigmas, mu) the pipeline passes to `scheduler.set_timesteps`: its grid linspace(1, 1/T, T) (None when
        the scheduler makes flow sigmas itself) and the empirical mu."""
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        return sigmas, empirical_mu(self.tokens(latent_shape), steps)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The Euler scheduler's sigmas for the pipeline's grid, shifted by the empirical mu."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = {k: v for k, v in self.scheduler_config.items() if not k.startswith("_")}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=empirical_mu(self.tokens(latent_shape), steps))
        return scheduler.sigmas.to(torch.float32)

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler), set as Flux2KleinPipeline sets it."""
        sigmas, mu = self.pipeline_grid(self.pipe.scheduler, steps, latent_shape)
        return folder_ode_scheduler(self.pipe.scheduler, steps, self.device, sigmas=sigmas, mu=mu)

    def to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Engine latents [B, 4C, h, w] to the VAE's [B, C, 2h, 2w]: the batch-norm statistics undone, the
        patches unfolded (the pipeline's order, so its `output_type="latent"` is this, bit for bit)."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, torch.float32)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(latents.device,
                                                                                                 torch.float32)
        x = latents.float() * std + mean
        b, c4, h, w = x.shape
        x = x.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return x.reshape(b, c4 // 4, h * 2, w * 2)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to images [B, 3, H, W] in [0, 1] (fp32)."""
        images = self.vae.decode(self.to_vae_latents(latents).to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0.0, 1.0)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(4C, H/2s, W/2s); H and W multiples of 2s (the 2x2 patches), default the pipeline's 1024 (tiny: 256)."""
        c, h, w = image_latent_shape(CARD_ID, height, width, frames, self.default_size, self.vae_scale,
                                     self.vae_scale * 2, self.transformer.config.in_channels)
        return (c, h // 2, w // 2)


def load_flux2_klein(path, device: torch.device, dtype: torch.dtype) -> Flux2KleinModel:
    """Load FLUX.2-klein from a local diffusers folder (every component in `dtype`)."""
    return load_family(Flux2KleinModel, PIPELINE, COMPONENTS, path, device, dtype)


register_card(ModelCard(
    id=CARD_ID,
    description="FLUX.2 [klein] (MM-DiT with single-stream blocks, Qwen3 text encoder, 2x2-patched normalised "
                "latents) from a local diffusers folder; CFG for base folders, none for step-distilled ones.",
    load=load_flux2_klein,
    # guidance 1: valid on distilled and base folders alike (a base folder's pipeline default is 4.0).
    defaults=dict(steps=8, guidance_scale=1.0, noise_level=0.7, height=512, width=512,
                  lora_targets=LORA_TARGETS, diffusers_pipeline=PIPELINE, video=False),
))
