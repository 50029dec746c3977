"""`Engine`: batched rollouts of a model card, stamped with the weight version.

The engine side of weight sync lives here too: `pause()` stops admitting new
generate calls, `drain()` waits for the running ones (which finish on the
version they started with), `load_weights()` copies new tensors in place and
bumps the version (or `set_weight_version()` / `invalidate_prompt_cache()`
when the caller already changed the module), and `resume()` lets waiting
calls in again.

Batch invariance: a request's noise comes from its own seed, so its output
does not depend on its batch neighbours up to the model's arithmetic. On the
CPU the toy model's matmuls may round differently at different batch sizes,
so the guarantee is <= 1e-5 (tested), not bitwise; the same request in the
same batch shape is bitwise reproducible.

Adaptive loop: a batch in which some request sets `cache_threshold` or
`early_exit` runs `engine.adaptive.AdaptiveLoop` (rows reuse their cached
velocity while it barely changes; rollouts only after their SDE window);
every other batch runs the plain loops below, unchanged. `Trajectory.steps_computed`
and `stats()` count the model calls.

Samplers: rollouts (sampler "sde" or "cps") always take the engine's own
steps, Euler outside the SDE window included, because the trained policy and
its log-probs are defined by them. ODE requests (evaluation, serving) on a
model whose folder's scheduler is not plain Euler (Wan's default UniPC) step
with that scheduler (`ode_scheduler`), so they equal the stock pipeline; their
Trajectory then carries the scheduler's sigmas as `timesteps`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from engine.adaptive import adaptive_loop_for, check_adaptive_path
from engine.cache import PromptEmbeddingCache
from engine.cards import FlowModel, PromptEmbeds, load_model
from engine.compiling import compile_for_rollouts
from engine.denoise import concat_embeds, denoise, denoise_with_scheduler
from engine.sampling import compressed_tail, flow_timesteps, step_noise_levels
from engine.types import GenerationRequest, Trajectory

PAUSE_MODES = ("drain",)
# Components whose weights feed the prompt-embedding cache: loading them invalidates it. A model whose
# encode_prompts runs other weighted modules (LTX-2's text connectors) names them in its own
# `prompt_encoder_components`, read by Engine.feeds_prompt_cache.
PROMPT_ENCODER_COMPONENTS = ("prompt_encoder", "text_encoder", "text_encoder_2", "text_encoder_3")


class Engine:
    """Generates batches of `GenerationRequest`s on one loaded model."""

    def __init__(self, model: FlowModel, device: torch.device | str | None = None, max_batch: int = 256,
                 weight_version: int = 0, time_shift: float = 1.0, prompt_cache_size: int = 4096,
                 compile: bool = False):
        self.model = model
        # torch.compile of the serving forward (engine.compiling). Parameters stay inputs of the
        # compiled graph (no freezing), so weights copied in place by a sync are used by the next
        # call, and the trainer's own forward and backward stay eager.
        self.compile = compile
        self._compiled: tuple[nn.Module, nn.Module] | None = None  # (module, its compiled wrapper)
        self.device = torch.device(device) if device is not None else next(model.transformer.parameters()).device
        self.max_batch = max_batch  # the properties below check these
        self.time_shift = time_shift
        self.prompt_cache = PromptEmbeddingCache(prompt_cache_size)
        self._weight_version = weight_version
        self._encoder_version = 0
        self._prompt_encoder_written = False  # write_weights touched an encoder since the last version
        self._state = threading.Condition()
        self._paused = False
        self._in_flight = 0
        # MixGRPO-Flash: the ODE steps after a rollout's SDE window run DPM-Solver++(2M) through this fraction
        # of them (`engine.sampling.compressed_tail`); None = Euler on every point. ODE requests never change.
        self.flash_compress: float | None = None
        # Row-steps generated and those that called the model (fewer when the adaptive loop reused a velocity).
        self._steps_total = 0
        self._steps_computed = 0

    # Settings checked when set: a bad value fails here, not as NaN latents or an IndexError mid-generate.

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Engine max_batch must be an integer >= 1 (rows per model call), got {value!r}")
        self._max_batch = value

    @property
    def time_shift(self) -> float:
        return self._time_shift

    @time_shift.setter
    def time_shift(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"Engine time_shift must be a finite number > 0 (1 = no shift; SD3 uses 3), "
                             f"got {value!r}")
        self._time_shift = float(value)

    @property
    def flash_compress(self) -> float | None:
        return self._flash_compress

    @flash_compress.setter
    def flash_compress(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 1):
            raise ValueError(f"Engine flash_compress must be None or in (0, 1] (the fraction of the ODE steps "
                             f"after the SDE window that are kept), got {value!r}")
        self._flash_compress = value

    @classmethod
    def from_card(cls, card_id: str, path: str | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, **kwargs) -> "Engine":
        return cls(load_model(card_id, path=path, device=device, dtype=dtype), device=device, **kwargs)

    @property
    def card_id(self) -> str:
        return self.model.card_id

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # ---- generation -------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], init_latents: torch.Tensor | None = None) -> Trajectory:
        """Generate every request; one Trajectory in request order.

        All requests must share a batch key (card, steps, sampler, guidance,
        size); they run in chunks of at most `max_batch`. `init_latents`
        [B, *latent]: image-to-image (SDEdit), each row's clean latent, which
        requests with `start_step` = k > 0 noise to t_k with their own seed
        before running steps k..T-1 (the Trajectory then holds those T-k steps).
        """
        if not requests:
            raise ValueError("generate() needs at least one request")
        self._check_batch(requests)
        self._check_init_latents(requests, init_latents)
        with self._state:
            while self._paused:
                self._state.wait()
            self._in_flight += 1
            version = self._weight_version
        try:
            parts = [self._generate_batch(requests[i:i + self.max_batch], version,
                                          None if init_latents is None else init_latents[i:i + self.max_batch])
                     for i in range(0, len(requests), self.max_batch)]
            return Trajectory.concat(parts)
        finally:
            with self._state:
                self._in_flight -= 1
                self._state.notify_all()

    def stats(self) -> dict[str, float]:
        """Since the engine started: row-steps generated, those that called the model, and the cache hit rate
        (the fraction that reused a cached velocity in the adaptive loop, engine/adaptive.py)."""
        with self._state:
            total, computed = self._steps_total, self._steps_computed
        return {"engine/steps": total, "engine/steps_computed": computed,
                "engine/cache_hit_rate": 1.0 - computed / total if total else 0.0}

    def generate_many(self, requests: list[GenerationRequest]) -> list[Trajectory]:
        """Generate heterogeneous requests; one single-row Trajectory per request, in request order.

        Requests are grouped by batch key (card, steps, sampler, guidance,
        size, ...) and each group runs as batches of up to `max_batch`.
        """
        if not requests:
            raise ValueError("generate_many() needs at least one request")
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            groups[r.batch_key()].append(i)
        results: list[Trajectory | None] = [None] * len(requests)
        for rows in groups.values():
            traj = self.generate([requests[i] for i in rows])
            for j, i in enumerate(rows):
                results[i] = traj.select([j])
        return results

    def _check_batch(self, requests: list[GenerationRequest]) -> None:
        key = requests[0].batch_key()
        image_conditioned = getattr(self.model, "image_conditioned", False)
        for i, r in enumerate(requests):
            if r.card != self.card_id:
                raise ValueError(f"request {i} asks for card {r.card!r} but this engine serves {self.card_id!r}")
            if image_conditioned and r.image is None:
                raise ValueError(f"request {i} has no image: card {self.card_id!r} is conditioned on one (set "
                                 f"GenerationRequest.image to a local image file)")
            if r.audio and not getattr(self.model, "generates_audio", False):
                raise ValueError(f"request {i} asks for audio but card {self.card_id!r} generates no sound; only "
                                 f"joint audio+video cards (ltx2) take audio=True")
            if not image_conditioned and r.image is not None:
                raise ValueError(f"request {i} has image={r.image!r} but card {self.card_id!r} takes no image; "
                                 f"only image-conditioned cards (image-to-video, editing) do")
            if r.negative_prompt and getattr(self.model, "embedded_guidance", False):
                raise ValueError(f"request {i} has negative_prompt={r.negative_prompt[:30]!r} but card "
                                 f"{self.card_id!r} is guidance-distilled (it has no unconditional branch), so it "
                                 f"would be ignored; leave negative_prompt empty")
            if r.batch_key() != key:
                raise ValueError(
                    f"request {i} cannot share a batch with request 0: batch keys differ "
                    f"({r.batch_key()} vs {key}); send them in separate generate() calls")

    def _check_init_latents(self, requests: list[GenerationRequest], init_latents: torch.Tensor | None) -> None:
        """Initial latents come with start_step > 0 (image-to-image) and only then, one row per request."""
        start = requests[0].start_step
        if init_latents is None:
            if start > 0:
                raise ValueError(f"start_step={start} starts from an image: pass its latents as "
                                 f"generate(requests, init_latents=[B, *latent])")
            return
        if start == 0:
            raise ValueError("init_latents were given but start_step=0 starts from pure noise and would ignore "
                             "them; set start_step in 1..steps-1 (the step the image is noised to)")
        first = requests[0]
        shape = (len(requests), *self.model.latent_shape(first.height, first.width, first.frames))
        if tuple(init_latents.shape) != shape:
            raise ValueError(f"init_latents must be [B, *latent] = {list(shape)} for these requests, "
                             f"got {list(init_latents.shape)}")
        if self.ode_scheduler(first, shape[1:]) is not None or (self.flash_compress is not None
                                                                and first.sampler != "ode"):
            raise ValueError(f"start_step > 0 runs the engine's own Euler/SDE steps; card {self.card_id!r} "
                             f"steps ODE requests with its folder's scheduler (or flash_compress is set), "
                             f"which this engine cannot start mid-schedule")

    def _generate_batch(self, requests: list[GenerationRequest], version: int,
                        init_latents: torch.Tensor | None = None) -> Trajectory:
        first = requests[0]
        latent_shape = self.model.latent_shape(first.height, first.width, first.frames)
        scheduler = self.ode_scheduler(first, latent_shape)
        multistep_from = None
        joint_audio = getattr(self.model, "generates_audio", False)
        audio_levels = None
        if scheduler is None:
            timesteps = self.schedule(first.steps, latent_shape)
            noise_levels = step_noise_levels(first.steps, first.sampler, first.noise_level, first.sde_window)
            if joint_audio:  # the audio's own level in the same window (0 on the video-only path: deterministic)
                audio_levels = step_noise_levels(first.steps, first.sampler, first.effective_audio_noise_level,
                                                 first.sde_window)
            window_end = first.sde_window[1] if first.sde_window is not None else first.steps
            if self.flash_compress is not None and first.sampler != "ode" and window_end < first.steps:
                # Flash: the window's steps as they are, the ODE after it on fewer points, second order.
                timesteps = compressed_tail(timesteps, window_end, self.flash_compress)
                tail = [0.0] * (len(timesteps) - 1 - window_end)
                noise_levels = noise_levels[:window_end] + tail
                audio_levels = None if audio_levels is None else audio_levels[:window_end] + tail
                multistep_from = window_end
        else:  # the scheduler's own states: its sigmas, one step per scheduler call
            timesteps = scheduler.sigmas.to(device=self.device, dtype=torch.float32)
            noise_levels = [0.0] * len(scheduler.timesteps)
            audio_levels = list(noise_levels) if joint_audio else None
        initial_noise, step_noise = self._draw_noise(requests, latent_shape, stochastic=first.sampler != "ode")
        if first.start_step > 0:  # SDEdit: x_{t_k} = (1 - t_k)·x0 + t_k·eps, then steps k..T-1 only
            k = first.start_step
            t_k = timesteps[k]
            initial_noise = (1 - t_k) * init_latents.to(device=self.device, dtype=torch.float32) + t_k * initial_noise
            timesteps, noise_levels = timesteps[k:], noise_levels[k:]
            audio_levels = None if audio_levels is None else audio_levels[k:]
            step_noise = None if step_noise is None else step_noise[:, k:]

        prompts = [r.prompt for r in requests]
        encode = self._prompt_encoder(requests)
        cond = encode(prompts)
        uncond = None
        if first.guided and not getattr(self.model, "embedded_guidance", False):
            uncond = encode([r.negative_prompt for r in requests])
        extra = {}
        if getattr(self.model, "image_conditioned", False):
            with torch.no_grad():
                extra.update(self.model.encode_images([r.image for r in requests], latent_shape))
        if hasattr(self.model, "conditioning_extra"):  # per-row settings the model reads (ltx2: audio guidance)
            extra.update(self.model.conditioning_extra(requests, latent_shape))
        if extra:
            cond = cond._replace(extra=extra)
            uncond = None if uncond is None else uncond._replace(extra=extra)
        uncond_cond = None if uncond is None else concat_embeds(uncond, cond)

        joint, loop_levels = {}, noise_levels
        if joint_audio:
            joint = self._joint_audio_levels(latent_shape, noise_levels, audio_levels, len(requests))
            loop_levels = [max(v, a) for v, a in zip(noise_levels, audio_levels)]  # stochastic where either is
        adaptive = adaptive_loop_for(requests)
        calls = len(requests) * len(loop_levels)  # the plain loops call the model for every row at every step
        steps_computed = torch.full((len(requests),), len(loop_levels), dtype=torch.long, device=self.device)
        if adaptive is not None:  # some request asked to reuse cached velocities (engine/adaptive.py)
            check_adaptive_path(self.card_id, first.sampler, scheduler is not None, multistep_from is not None,
                                joint_audio)
            result = adaptive(self.model, self.serving_transformer(), initial_noise, step_noise, timesteps,
                              loop_levels, cond, uncond_cond, first.guidance_scale,
                              keep_trajectory=first.keep_trajectory, sampler=first.sampler)
            latents, log_probs = result.latents, result.log_probs
            steps_computed, calls = result.steps_computed.to(self.device), int(result.computed.sum())
        elif scheduler is None:
            latents, log_probs = denoise(self.model, self.serving_transformer(), initial_noise, step_noise,
                                         timesteps, loop_levels, cond, uncond_cond, first.guidance_scale,
                                         keep_trajectory=first.keep_trajectory, sampler=first.sampler,
                                         multistep_from=multistep_from, **joint)
        else:
            latents, log_probs = denoise_with_scheduler(self.model, self.serving_transformer(), initial_noise,
                                                        scheduler, cond, uncond_cond, first.guidance_scale,
                                                        keep_trajectory=first.keep_trajectory)
        with self._state:
            self._steps_total += len(requests) * len(loop_levels)
            self._steps_computed += calls
        with torch.no_grad():
            images = self.model.decode(latents[:, -1])
            audio = self.model.decode_audio(latents[:, -1]) if first.audio else None
        return Trajectory(
            latents=latents, log_probs=log_probs, timesteps=timesteps,
            noise_levels=torch.tensor(noise_levels, dtype=torch.float32, device=self.device),
            prompt_embeds=cond.embeds, pooled_prompt_embeds=cond.pooled, prompt_mask=cond.mask,
            negative_prompt_embeds=None if uncond is None else uncond.embeds,
            negative_pooled_prompt_embeds=None if uncond is None else uncond.pooled,
            negative_prompt_mask=None if uncond is None else uncond.mask,
            images=images, prompts=prompts, seeds=[r.seed for r in requests], card=self.card_id,
            weight_version=version, guidance_scale=first.guidance_scale,
            metadata=[row_metadata(r) for r in requests], sampler=first.sampler, condition_extra=cond.extra,
            audio_noise_levels=(None if audio_levels is None
                                else torch.tensor(audio_levels, dtype=torch.float32, device=self.device)),
            audio_elements=self.model.audio_elements(latent_shape) if joint_audio else 0,
            modality_log_probs=joint.get("parts_out"), audio=audio,
            audio_sample_rate=self.model.audio_sample_rate if first.audio else None, steps_computed=steps_computed)

    def _joint_audio_levels(self, latent_shape: tuple[int, ...], video_levels: list[float],
                            audio_levels: list[float], batch: int) -> dict:
        """denoise()'s per-element arguments for a flat [video | audio] latent: each step's levels [N] (video
        elements at the video's level, the audio's at its own), the two parts and their log-prob buffers."""
        n = math.prod(latent_shape)
        n_audio = self.model.audio_elements(latent_shape)
        element_levels = [torch.cat([torch.full((n - n_audio,), v, dtype=torch.float32, device=self.device),
                                     torch.full((n_audio,), a, dtype=torch.float32, device=self.device)])
                          for v, a in zip(video_levels, audio_levels)]
        parts = {"video": (0, n - n_audio), "audio": (n - n_audio, n)}
        parts_out = {name: torch.zeros((batch, len(video_levels)), dtype=torch.float32, device=self.device)
                     for name in parts}
        return {"element_levels": element_levels, "parts": parts, "parts_out": parts_out}

    def serving_transformer(self) -> nn.Module:
        """The module rollouts call: the model's transformer, compiled once per module when `compile`."""
        transformer = self.model.transformer
        if not self.compile:
            return transformer
        if self._compiled is None or self._compiled[0] is not transformer:
            self._compiled = (transformer, compile_for_rollouts(transformer))
        return self._compiled[1]

    def ode_scheduler(self, request: GenerationRequest, latent_shape: tuple[int, ...]):
        """The scheduler an ODE request steps with: a fresh instance of the model folder's own when it is
        not plain Euler. None otherwise, and always for rollouts ("sde", "cps"): they keep the engine's
        samplers, Euler steps outside the SDE window included, on which the trained policy is defined."""
        if request.sampler != "ode" or not hasattr(self.model, "ode_scheduler"):
            return None
        return self.model.ode_scheduler(request.steps, latent_shape)

    def schedule(self, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """The flow times t_0 = 1 > ... > t_T = 0: the model's own schedule if it has one
        (FLUX shifts by resolution), else the engine's shifted linear schedule."""
        if hasattr(self.model, "schedule"):
            return self.model.schedule(steps, latent_shape).to(device=self.device, dtype=torch.float32)
        return flow_timesteps(steps, self.time_shift, device=self.device)

    def _draw_noise(self, requests: list[GenerationRequest], latent_shape: tuple[int, ...],
                    stochastic: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All noise of the rollout, drawn before the loop from one generator per request.

        A request's noise depends only on its seed, never on its batch
        neighbours; the initial noise is drawn first, so ODE and SDE runs of
        one seed start from the same point. A request with a `noise_seed` starts
        from that seed's initial noise; its step noise is still its own seed's.
        """
        steps = requests[0].steps
        initial, per_step = [], []
        for r in requests:
            generator = torch.Generator(device=self.device).manual_seed(r.seed)
            own = torch.randn(latent_shape, generator=generator, device=self.device)
            if r.noise_seed is not None:
                shared = torch.Generator(device=self.device).manual_seed(r.noise_seed)
                own = torch.randn(latent_shape, generator=shared, device=self.device)
            initial.append(own)
            if stochastic:
                per_step.append(torch.randn((steps, *latent_shape), generator=generator, device=self.device))
        return torch.stack(initial), (torch.stack(per_step) if stochastic else None)

    def _prompt_encoder(self, requests: list[GenerationRequest]):
        """How this batch's prompts are embedded: through the cache, or, for a card whose text encoder reads
        the source image with the prompt (`prompts_read_images`: Qwen-Image-Edit), with each row's image."""
        if not getattr(self.model, "prompts_read_images", False):
            return self.encode_prompts
        images = [r.image for r in requests]

        def encode(prompts: list[str]) -> PromptEmbeds:
            with torch.no_grad():
                return self.model.encode_prompts(prompts, images=images)

        return encode

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Prompt embeddings through the LRU cache (one encoder call for all misses)."""
        # The encoder's length limit is part of the key: a model whose limit is changed must not get
        # embeddings of the old length back.
        limit = getattr(self.model, "max_sequence_length", getattr(self.model, "max_length", None))
        keys = [(self.card_id, p, self._encoder_version, limit) for p in prompts]
        found = {k: self.prompt_cache.get(k) for k in dict.fromkeys(keys)}
        missing = [k for k, v in found.items() if v is None]
        if missing:
            with torch.no_grad():
                fresh = self.model.encode_prompts([k[1] for k in missing])
            for i, k in enumerate(missing):
                entry = (fresh.embeds[i], fresh.pooled[i], None if fresh.mask is None else fresh.mask[i])
                found[k] = entry
                # A clone per row: a view would keep the whole miss batch's tensors alive in the cache.
                self.prompt_cache.put(k, tuple(None if t is None else t.clone() for t in entry))
        rows = [found[k] for k in keys]
        mask = None if rows[0][2] is None else torch.stack([r[2] for r in rows])
        return PromptEmbeds(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), mask)

    # ---- engine side of weight sync -----------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight(self) -> int:
        """generate() calls running now."""
        return self._in_flight

    def pause(self, mode: str = "drain") -> None:
        """Stop admitting new generate() calls; running ones carry on ("drain": nothing is dropped).

        Calls that arrive while paused wait and run after `resume()` on the new version.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not supported; valid modes: {', '.join(PAUSE_MODES)}")
        with self._state:
            self._paused = True

    def drain(self, timeout_s: float = 600.0) -> float:
        """Wait until no generate() call is running; returns the seconds waited."""
        start = time.perf_counter()
        with self._state:
            if not self._paused:
                raise RuntimeError("drain() needs pause() first, or new calls could keep arriving")
            if not self._state.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                raise TimeoutError(f"engine did not drain within {timeout_s:.1f}s: "
                                   f"{self._in_flight} generate() call(s) still running")
        return time.perf_counter() - start

    def feeds_prompt_cache(self, component: str) -> bool:
        """Whether `component`'s weights shape the cached prompt embeddings."""
        return component in getattr(self.model, "prompt_encoder_components", PROMPT_ENCODER_COMPONENTS)

    def set_weight_version(self, version: int, prompt_encoder_changed: bool = False) -> None:
        """Mark the weights now loaded; versions only increase.

        The prompt cache is dropped when the caller says the encoder changed or when write_weights wrote
        into one since the last version (a bucketed sync whose commit forgot to say so)."""
        if version <= self._weight_version:
            raise ValueError(f"weight version must increase: {version} <= current {self._weight_version}")
        self._weight_version = version
        if prompt_encoder_changed or self._prompt_encoder_written:
            self.invalidate_prompt_cache()
        self._prompt_encoder_written = False

    def invalidate_prompt_cache(self) -> None:
        """Forget every prompt embedding (the prompt encoder's weights changed)."""
        self._encoder_version += 1
        self.prompt_cache.invalidate()

    def resume(self) -> None:
        """Admit generate() calls again (they run on the current version)."""
        with self._state:
            self._paused = False
            self._state.notify_all()

    def load_weights(self, tensors: dict[str, torch.Tensor] | str | Path, version: int,
                     component: str = "transformer") -> dict:
        """Copy named tensors into the served `component` in place, then mark `version`.

        `tensors` is a name -> tensor dict or the path of a .safetensors file;
        names are the component's state-dict names (a file whose keys carry a
        "<component>." prefix is filtered and stripped). Every name and shape
        is checked before anything is copied. If the engine is not paused this
        does the whole freeze -> drain -> load -> resume itself; if it is, it
        drains and loads and leaves resuming to the caller. Loading a prompt
        encoder invalidates the prompt-embedding cache.
        """
        module = self.component(component)
        state = module.state_dict(keep_vars=True)
        from_file = isinstance(tensors, (str, Path))
        tensors = _named_tensors(tensors, (component, self._component_attr(component)), state)
        _check_tensors(state, tensors, component)
        if from_file:  # a file may come from anywhere; a sender's own tensors are the sender's to check
            _check_finite_as(state, tensors, component)
        if version <= self._weight_version:
            raise ValueError(f"weight version must increase: {version} <= current {self._weight_version}")
        was_paused = self._paused
        if not was_paused:
            self.pause()
        try:
            drain_s = self.drain()
            start = time.perf_counter()
            self.write_weights(tensors, component)
            self.set_weight_version(version, prompt_encoder_changed=self.feeds_prompt_cache(component))
            return {"version": version, "component": component, "tensors": len(tensors),
                    "drain_s": drain_s, "load_s": time.perf_counter() - start}
        finally:
            if not was_paused:
                self.resume()

    def write_weights(self, tensors: dict[str, torch.Tensor], component: str = "transformer") -> int:
        """Copy named tensors into `component` in place without marking a version; returns bytes written.

        The transfer phase of a sync that arrives in parts (buckets): the engine
        must be paused and drained, and `set_weight_version` commits. Every
        name and shape is checked before anything is copied.
        """
        with self._state:
            if not self._paused or self._in_flight:
                raise RuntimeError("write_weights needs a paused, drained engine "
                                   f"(paused={self._paused}, generate() calls running={self._in_flight})")
        module = self.component(component)
        state = module.state_dict(keep_vars=True)
        tensors = _named_tensors(tensors, (component, self._component_attr(component)), state)
        targets = _check_tensors(state, tensors, component)
        self._prompt_encoder_written |= self.feeds_prompt_cache(component)
        with torch.no_grad():
            for name, tensor in tensors.items():
                targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _component_attr(self, name: str) -> str:
        return "text_encoder" if name == "prompt_encoder" and not hasattr(self.model, name) else name

    def component(self, name: str) -> nn.Module:
        """The model's module called `name` ("prompt_encoder" finds the text encoder)."""
        module = getattr(self.model, self._component_attr(name), None)
        if not isinstance(module, nn.Module):
            known = sorted(k for k, v in vars(self.model).items() if isinstance(v, nn.Module))
            raise ValueError(f"model {self.card_id!r} has no component {name!r}; "
                             f"components with weights: {', '.join(known)}")
        return module


def _named_tensors(tensors: dict[str, torch.Tensor] | str | Path, names: tuple[str, ...],
                   state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A name -> tensor dict from a dict or a .safetensors path, with a "<component>." prefix stripped.

    Once a name carries the prefix, the unprefixed names are another component's and are passed over, except
    names of this component's own weights (`state`): a file mixing both forms would lose those silently."""
    if isinstance(tensors, (str, Path)):
        from safetensors.torch import load_file

        path = Path(tensors)
        if not path.is_file():
            raise FileNotFoundError(f"no safetensors file at {path}")
        tensors = load_file(str(path))
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("load_weights needs a non-empty dict of name -> tensor or a .safetensors path")
    for prefix in dict.fromkeys(n + "." for n in names):
        if any(k.startswith(prefix) for k in tensors):
            plain = [k for k in tensors if not k.startswith(prefix) and k in state]
            if plain:
                raise ValueError(f"the tensors mix names with the {prefix!r} prefix and without it: "
                                 f"{len(plain)} unprefixed name(s) of this component ({plain[:3]}) would be "
                                 f"ignored; name every tensor one way")
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return tensors


def _check_finite_as(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], component: str) -> None:
    """ValueError naming the first floating-point tensor that is not finite once cast to the dtype of the weight
    it replaces (float64 1e300 is inf in float32): copied, it would make every output NaN."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.to(state[name].dtype)).all()):
            raise ValueError(f"tensor {name!r} holds values that are NaN or inf as {state[name].dtype} (the "
                             f"{component} weight's dtype); refusing to load it")


def _check_tensors(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                   component: str) -> dict[str, torch.Tensor]:
    """The target parameters/buffers of `tensors`; a clear error on unknown names or mismatched shapes."""
    unknown = [k for k in tensors if k not in state]
    if unknown:
        raise KeyError(f"{len(unknown)} tensor name(s) are not in {component}: {unknown[:5]}; "
                       f"examples of valid names: {list(state)[:5]}")
    bad = [f"{k}: got {tuple(v.shape)}, expected {tuple(state[k].shape)}"
           for k, v in tensors.items() if tuple(v.shape) != tuple(state[k].shape)]
    if bad:
        raise ValueError(f"{len(bad)} tensor(s) have the wrong shape for {component}: {bad[:5]}")
    return {k: state[k] for k in tensors}


def row_metadata(request: GenerationRequest) -> dict:
    """A trajectory row's metadata: the request's, with its conditioning image's path under "image" when the
    request has one its metadata does not name (what editing rewards score the output against)."""
    metadata = dict(request.metadata)
    if request.image is not None:
        metadata.setdefault("image", request.image)
    return metadata
