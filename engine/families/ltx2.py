"""The `ltx2` card: LTX-2 joint audio+video generation through diffusers' LTX2VideoTransformer3DModel.

One denoise runs over a video latent and an audio latent together: the
transformer takes both token sequences (they attend to each other) and
predicts both velocities. The engine sees ONE flat fp32 vector per sample,

    latent = [video tokens (F'·H'·W' x C) | audio tokens (L x C_a·M)]

in the order and normalisation of `LTX2Pipeline`'s own denoise loop (packed
tokens, the audio normalised by the audio VAE's mean and std), so the denoise
loop, the Trajectory, the samplers and the trainers' recomputation stay
generic: `velocity` unpacks, calls the transformer, packs.

Why every sample carries the audio, video-only requests too: the video's
velocity depends on the audio tokens (audio-to-video cross-attention), so the
video-only path is the joint model with its audio part stepped
deterministically (the ODE, noise level 0, at the video's guidance) and never
decoded, which is what the stock pipeline does for its video. A trainer
recomputing a step then sees the same audio state the rollout saw, and the
video-only path equals `LTX2Pipeline`'s video (tested). An audio request
(`GenerationRequest.audio`) runs the same code with the audio's own noise
level and guidance scale, and decodes the audio (audio VAE + vocoder).

The latent geometry (frames, height, width, audio length) travels with each
row as `PromptEmbeds.extra["ltx2_grid"]`, a tensor with no elements whose
shape is [B, F', H', W', L, 0]: the model reads it from `.shape` (no host
transfer in the loop) and it reaches the trainers' forwards through
`Trajectory.condition_extra`. The per-row audio guidance scale travels as
`extra["audio_guidance_scale"]` [B]; `guide` applies the video's scale to the
video elements and that one to the audio elements.

Deviations from `LTX2Pipeline.__call__` (whose defaults add more guidance
terms): classifier-free guidance only, v_u + g·(v_c - v_u) (the pipeline
forms it on x0 = x - sigma·v, the same value up to rounding); no
spatio-temporal guidance (stg_scale 0), no modality-isolation guidance
(modality_scale 1) and no guidance rescale (guidance_rescale 0): each is an
extra transformer forward or a non-linear rescale of the guided prediction,
and parity is measured with the pipeline set the same way. The frame rate is
the pipeline's default, 24 fps (it sets the audio length and the RoPE
positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cards import PromptEmbeds
from engine.families.common import (DiffusersFlowModel, flow_time_to_batch, flux_shift_mu, folder_ode_scheduler,
                                    load_family, scheduler_flow_times)

CARD_ID = "ltx2"
PIPELINE = "LTX2Pipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "audio_vae": "model", "vocoder": "model",
              "connectors": "model", "text_encoder": "model", "tokenizer": "tokenizer", "scheduler": "scheduler"}
FRAME_RATE = 24.0  # LTX2Pipeline's default frame_rate (motion_speed 1)
GRID_KEY = "ltx2_grid"
AUDIO_GUIDANCE_KEY = "audio_guidance_scale"
# Every attention projection of the joint blocks: video and audio self-attention, their text
# cross-attention, and the two audio<->video cross-attentions.
LORA_TARGETS = [f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2",
                                              "audio_to_video_attn", "video_to_audio_attn")
                for proj in ("to_q", "to_k", "to_v", "to_out.0")]


@dataclass(frozen=True)
class Grid:
    """One request size's latent geometry: video tokens F'·H'·W' of `video_width` features, audio tokens L."""

    frames: int
    height: int
    width: int
    audio_frames: int
    video_width: int
    audio_width: int

    @property
    def video_elements(self) -> int:
        return self.frames * self.height * self.width * self.video_width

    @property
    def audio_elements(self) -> int:
        return self.audio_frames * self.audio_width


class LTX2Model(DiffusersFlowModel):
    """FlowModel of LTX-2: flat [video | audio] latents, per-modality guidance, audio decoded on request."""

    card_id = CARD_ID
    generates_audio = True
    guide_uses_conditioning = True
    # encode_prompts runs Gemma and then the text connectors: loading either changes the cached embeddings.
    prompt_encoder_components = ("prompt_encoder", "text_encoder", "connectors")

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = 1024):
        super().__init__(pipe, dtype, scheduler_config, pipe.tokenizer, max_sequence_length)
        self.audio_vae = pipe.audio_vae
        self.vocoder = pipe.vocoder
        self.connectors = pipe.connectors
        self.text_encoder = pipe.text_encoder
        config = self.transformer.config
        self.patch, self.patch_t = config.patch_size, config.patch_size_t
        connectors = pipe.connectors.config
        # Width of the video connector's output: the audio connector's follows it in PromptEmbeds.embeds.
        self.video_text_width = (connectors.video_hidden_dim if connectors.per_modality_projections
                                 else connectors.caption_channels)
        self.conditioning_fps = _conditioning_frame_rate(FRAME_RATE)
        self.audio_sample_rate = int(pipe.vocoder.config.output_sampling_rate)
        self._grids: dict[int, Grid] = {}  # flat latent length -> geometry (schedule and decode read it)

    # ---- geometry -------------------------------------------------------------------------

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(N,): the flat [video | audio] latent of a height x width, `frames`-frame request (default
        512x768, 121 frames); H and W multiples of 32, frames = 8k+1 for the released VAE (its temporal ratio)."""
        pipe = self.pipe
        height, width, frames = height or 512, width or 768, frames or 121
        spatial, temporal = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        multiple = max(32, spatial * self.patch)  # LTX2Pipeline.check_inputs asks for multiples of 32
        if height % multiple or width % multiple:
            raise ValueError(f"{CARD_ID}: height and width must be multiples of {multiple}; got {height}x{width}")
        if (frames - 1) % temporal:
            valid = ", ".join(str(temporal * k + 1) for k in range(1, 5))
            raise ValueError(f"{CARD_ID}: frames must be {temporal}k+1 (this folder's VAE compresses time by "
                             f"{temporal}): {valid}, ...; got {frames}")
        latent_frames = (frames - 1) // temporal + 1
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        grid = Grid(frames=latent_frames // self.patch_t, height=height // spatial // self.patch,
                    width=width // spatial // self.patch, audio_frames=round(frames / FRAME_RATE * per_second),
                    video_width=self.transformer.config.in_channels,
                    audio_width=self.transformer.config.audio_in_channels)
        n = grid.video_elements + grid.audio_elements
        known = self._grids.setdefault(n, grid)
        if known != grid:
            raise ValueError(f"{CARD_ID}: this size gives the same latent length ({n}) as another size already "
                             f"served ({known}); one engine serves one of them (e.g. not both HxW and WxH)")
        return (n,)

    def decoded_frames(self, frames: int | None) -> tuple[int, int, str]:
        """(frames asked, frames the video VAE decodes them to, why they differ), from the VAE's config alone.

        The latent keeps (F - 1)/r + 1 frames for the pipeline's temporal ratio r (patch_size_t·2^(scaled
        encoder blocks), as diffusers computes it); each decoder block that scales with a temporal upsample
        ("temporal" or "spatiotemporal") doubles the frames less the first (2F' - 1). The released VAE does
        both 8x; a folder whose encoder counts a scaling its blocks do only in space (downsample_type
        "spatial") decodes fewer frames than asked.
        """
        frames = frames or 121
        temporal = self.pipe.vae_temporal_compression_ratio
        config = self.vae.config
        blocks = len(config.decoder_block_out_channels)
        scaling = config.decoder_spatio_temporal_scaling
        scaling = (scaling,) * (blocks - 1) if isinstance(scaling, bool) else tuple(scaling)
        kinds = config.upsample_type if not isinstance(config.upsample_type, str) else (config.upsample_type,) * blocks
        latent = (frames - 1) // temporal + 1
        got, upsample = latent, 1
        for scaled, kind in zip(scaling, kinds):
            if scaled and kind in ("temporal", "spatiotemporal"):
                got, upsample = 2 * got - 1, upsample * 2
        why = (f"this folder's video VAE keeps (frames - 1)/{temporal} + 1 = {latent} latent frames (temporal "
               f"compression {temporal}) but its decoder upsamples time by {upsample}, so {frames} frames decode to "
               f"{got}; with it, {temporal}k+1 frames give {upsample if upsample > 1 else ''}k+1 (the released "
               "LTX-2 VAE compresses and upsamples by 8: 8k+1 frames in and out)")
        return frames, got, why

    def grid(self, shape_or_latents: tuple[int, ...] | torch.Tensor) -> Grid:
        """The geometry of a latent shape (N,) or of flat latents [..., N] of a size this model has served."""
        shape = shape_or_latents if isinstance(shape_or_latents, tuple) else tuple(shape_or_latents.shape)
        n = shape[-1]
        if n not in self._grids:
            raise ValueError(f"{CARD_ID}: no request size gives a latent of {n} elements; call latent_shape first")
        return self._grids[n]

    def audio_elements(self, latent_shape: tuple[int, ...]) -> int:
        """How many trailing elements of a flat latent are the audio."""
        return self.grid(latent_shape).audio_elements

    def conditioning_extra(self, requests, latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Per-row conditioning the engine adds to PromptEmbeds.extra: the geometry (in a shape) and the
        audio guidance scale (the video's on the video-only path)."""
        g = self.grid(latent_shape)
        batch = len(requests)
        return {GRID_KEY: torch.empty((batch, g.frames, g.height, g.width, g.audio_frames, 0), device=self.device),
                AUDIO_GUIDANCE_KEY: torch.tensor([r.effective_audio_guidance for r in requests],
                                                 dtype=torch.float32, device=self.device)}

    def _cond_grid(self, cond: PromptEmbeds) -> Grid:
        if cond.extra is None or GRID_KEY not in cond.extra:
            raise ValueError(f"{CARD_ID}: the conditioning has no extra[{GRID_KEY!r}] (the latent geometry the "
                             f"engine adds); build it from the Trajectory's condition_extra")
        _, frames, height, width, audio_frames, _ = cond.extra[GRID_KEY].shape
        config = self.transformer.config
        return Grid(frames, height, width, audio_frames, config.in_channels, config.audio_in_channels)

    # ---- text ------------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Gemma hidden states through the text connectors: [video | audio] connector outputs side by side
        in `embeds` [B, L, D_v + D_a] (fp32), the connectors' mask in `mask`; no pooled embedding ([B, 0])."""
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                max_sequence_length=self.max_sequence_length, device=self.device)
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = self.connectors(embeds, mask, padding_side=padding_side)
        joined = torch.cat([video, audio], dim=-1).float()
        return PromptEmbeds(joined, joined.new_zeros(joined.shape[0], 0), mask)

    # ---- the denoiser ------------------------------------------------------------------------

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32, flat [video | audio]) of both modalities in one transformer forward."""
        g = self._cond_grid(cond)
        batch = latents.shape[0]
        video = latents[:, :g.video_elements].reshape(batch, -1, g.video_width).to(self.dtype)
        audio = latents[:, g.video_elements:].reshape(batch, -1, g.audio_width).to(self.dtype)
        embeds = cond.embeds.to(self.dtype)
        timestep = flow_time_to_batch(t, batch, latents.device) * 1000.0
        v_video, v_audio = transformer(
            hidden_states=video, audio_hidden_states=audio,
            encoder_hidden_states=embeds[..., :self.video_text_width],
            audio_encoder_hidden_states=embeds[..., self.video_text_width:],
            timestep=timestep, sigma=timestep, encoder_attention_mask=cond.mask,
            audio_encoder_attention_mask=cond.mask, num_frames=g.frames, height=g.height, width=g.width,
            fps=self.conditioning_fps, audio_num_frames=g.audio_frames, use_cross_timestep=True, return_dict=False)
        return torch.cat([v_video.float().flatten(1), v_audio.float().flatten(1)], dim=1)

    def guide(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float,
              cond: PromptEmbeds) -> torch.Tensor:
        """CFG per modality: the video elements at `guidance_scale`, the audio ones at each row's audio scale."""
        n = self._cond_grid(cond).video_elements
        audio_scale = cond.extra[AUDIO_GUIDANCE_KEY].to(v_cond.device).reshape(-1, 1)
        video = v_uncond[:, :n] + guidance_scale * (v_cond[:, :n] - v_uncond[:, :n])
        audio = v_uncond[:, n:] + audio_scale * (v_cond[:, n:] - v_uncond[:, n:])
        return torch.cat([video, audio], dim=1)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """LTX2Pipeline's flow times: sigmas linspace(1, 1/T) shifted by the video token count (mu)."""
        return scheduler_flow_times(self.scheduler_config, steps, image_seq_len=self._video_tokens(latent_shape),
                                    flux_sigmas=True)

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's scheduler for an ODE request (None for Euler), set as LTX2Pipeline sets it. One
        scheduler steps both modalities: the pipeline steps a copy per modality, the same elementwise update."""
        import numpy as np

        scheduler = self.pipe.scheduler
        mu = flux_shift_mu(self._video_tokens(latent_shape), scheduler.config)
        return folder_ode_scheduler(scheduler, steps, self.device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    def _video_tokens(self, latent_shape: tuple[int, ...]) -> int:
        g = self.grid(latent_shape)
        return g.frames * g.height * g.width

    # ---- outputs -----------------------------------------------------------------------------

    def split_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat latents [B, N] as LTX2Pipeline's output_type="latent" gives them: video [B, C, F', H', W'] and
        audio [B, C_a, L, M], both denormalised (fp32)."""
        pipe, g = self.pipe, self.grid(latents)
        batch = latents.shape[0]
        video = latents[:, :g.video_elements].reshape(batch, -1, g.video_width).float()
        video = pipe._unpack_latents(video, g.frames, g.height, g.width, self.patch, self.patch_t)
        video = pipe._denormalize_latents(video, self.vae.latents_mean, self.vae.latents_std,
                                          self.vae.config.scaling_factor)
        audio = latents[:, g.video_elements:].reshape(batch, g.audio_frames, g.audio_width).float()
        audio = pipe._denormalize_audio_latents(audio, self.audio_vae.latents_mean, self.audio_vae.latents_std)
        mel_bins = self.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, g.audio_frames, num_mel_bins=mel_bins)
        return video, audio

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Flat latents to videos [B, 3, F, H, W] in [0, 1] (fp32), as the pipeline decodes (decode_timestep 0)."""
        video, _ = self.split_latents(latents)
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.zeros(video.shape[0], dtype=self.vae.dtype, device=video.device)
        frames = self.vae.decode(video.to(self.vae.dtype), timestep, return_dict=False)[0]
        return (frames.float() / 2 + 0.5).clamp(0.0, 1.0)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Flat latents to waveforms [B, channels, samples] in [-1, 1] (fp32) at `audio_sample_rate` Hz:
        the audio VAE decodes a mel spectrogram, the vocoder turns it into sound."""
        _, audio = self.split_latents(latents)
        mel = self.audio_vae.decode(audio.to(self.audio_vae.dtype), return_dict=False)[0]
        waveform = self.vocoder(mel.to(next(self.vocoder.parameters()).dtype))
        return waveform.float().clamp(-1.0, 1.0)


def _conditioning_frame_rate(frame_rate: float) -> float:
    """The frame rate the pipeline gives the transformer's RoPE (motion_speed 1)."""
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

    return conditioning_frame_rate(frame_rate, 1.0)


def load_ltx2(path, device: torch.device, dtype: torch.dtype) -> LTX2Model:
    """Load LTX-2 from a local diffusers folder (every component in `dtype`)."""
    return load_family(LTX2Model, PIPELINE, COMPONENTS, path, device, dtype)


def _load(path, device, dtype):
    return load_ltx2(path, device, dtype)


def _register() -> None:
    from engine.cards import ModelCard, register_card

    register_card(ModelCard(
        id=CARD_ID,
        description="LTX-2 joint audio+video (Gemma-3 + connectors, audio-video DiT, video VAE, audio VAE + "
                    "vocoder) from a local diffusers folder; videos [B, C, F, H, W], audio on request.",
        load=_load,
        defaults=dict(steps=10, guidance_scale=3.0, noise_level=0.7, height=512, width=768, frames=121,
                      lora_targets=LORA_TARGETS, diffusers_pipeline=PIPELINE, video=True, audio=True,
                      fps=int(FRAME_RATE)),
        components={"prompt_encoder": "Gemma-3 + text connectors", "transformer": "LTX2VideoTransformer3DModel",
                    "decoder": "video VAE; audio VAE + vocoder"},
        latent_rule="flat [video (C, (F-1)/8+1, H/32, W/32) | audio (L = F/24 s at 25 latents/s, C_a·M)]",
    ))


_register()
