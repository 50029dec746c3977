"""Core types of the engine: what a caller asks for and what a rollout returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real

import torch

SAMPLERS = ("ode", "sde", "cps")
# Sane ranges: wide enough for any real use, narrow enough that a typo (or 1e308 from a
# client) is refused before it becomes NaN images or an overflow deep in the loop.
MAX_STEPS = 1000
MAX_GUIDANCE = 100.0  # CFG scales in use are ~1-20
MAX_NOISE_LEVEL = 10.0  # Flow-SDE `a` in use is ~0.3-1.5; sigma_t grows linearly in it
MAX_SIZE = 16384  # pixels per side
MAX_FRAMES = 4096
MAX_CACHE_THRESHOLD = 1.0  # the adaptive loop's tolerances are relative changes: 1 already skips nearly everything
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
DEFAULT_NOISE_LEVEL = 0.7  # Flow-GRPO's a; also the CPS eta a request gets when it names none


def _integer(name: str, value: object, low: int, high: int, nullable: bool = False) -> None:
    """TypeError unless `value` is an integer (not a bool), ValueError unless low <= value <= high."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer{' or None' if nullable else ''}, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}={str(value)[:30]} is out of range; valid: {low} <= {name} <= {high}")


def _number(name: str, value: object, low: float, high: float) -> None:
    """TypeError unless `value` is a real number (not a bool), ValueError unless finite and in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    # Compared before any float(): an int like 10**400 has no float.
    if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name}={str(value)[:30]} is out of range; valid: {low:g} <= {name} <= {high:g}")


# What a stochastic sampler takes and the ODE refuses.
NOISE_FIELDS = ("noise_level", "audio_noise_level", "sde_window")


def overlay_request_fields(base: dict, overrides: dict) -> dict:
    """`base`'s request fields with `overrides` on top. Overriding the sampler to "ode" also resets the noise
    fields `base` held for its stochastic sampler (NOISE_FIELDS), unless `overrides` names them: an ODE
    evaluation of SDE rollouts' settings asks for the ODE, not for their noise level to be ignored."""
    merged = {**base, **overrides}
    if overrides.get("sampler") == "ode":
        merged.update({name: None for name in NOISE_FIELDS if name not in overrides})
    return merged


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. Requests with the same `batch_key` run in one batch."""

    prompt: str
    seed: int
    negative_prompt: str = ""
    steps: int = 10
    guidance_scale: float = 1.0
    sampler: str = "sde"
    # Flow-SDE's `a` for "sde"; CPS's eta in [0, 1) for "cps". None: DEFAULT_NOISE_LEVEL for those two, 0 for
    # "ode", which draws no noise and refuses any other level (it would be ignored).
    noise_level: float | None = None
    # Half-open range [start, end) of step indices that are stochastic and
    # recorded; None means every step. Steps outside it are plain ODE steps.
    sde_window: tuple[int, int] | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    card: str = "toy-digits"
    keep_trajectory: bool = True
    # The conditioning image of an image-conditioned card (image-to-video's first frame): a local file
    # path. Per row, like the prompt, so not part of the batch key; other cards refuse it.
    image: str | None = None
    # Sound (a card that generates it: ltx2). Off: the card's video-only path. The audio's own CFG scale and
    # Flow-SDE/CPS noise level, None = the video's (guidance_scale, noise_level); 0 noise = deterministic audio.
    audio: bool = False
    audio_guidance_scale: float | None = None
    audio_noise_level: float | None = None
    # Image-to-image (SDEdit): start at step `start_step` of the `steps`-step schedule from an initial latent
    # the caller gives (Engine.generate(init_latents=...)), noised to t_start with this request's seed; only
    # steps start_step..steps-1 run. 0 = from pure noise (text-to-image), every existing request.
    start_step: int = 0
    # The content-adaptive loop (engine/adaptive.py) for evaluation and serving, per row (not in the batch key):
    # skip the model while the row's estimated relative velocity change since its last call is below
    # cache_threshold (0 = never skip), and stop calling it once its data prediction x - t·v, at the pace it
    # changed since the last call, would change by less than early_exit until t = 0 (None = never exit).
    # Rollouts ("sde", "cps") skip only the ODE steps after
    # their SDE window, so every trained step's log-prob is the plain loop's.
    cache_threshold: float = 0.0
    early_exit: float | None = None
    # What a skipped step uses: 1 = the line through the row's last two model calls, 0 = the last call's velocity.
    cache_order: int = 1
    # The seed of the initial noise x_1 alone; None = `seed`. Requests that share one start from the same noise
    # (a group's samples: MixGRPO's init_same_noise), while their SDE step noise still comes from `seed`.
    noise_seed: int | None = None
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("prompt", "negative_prompt", "card"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.image is not None and (not isinstance(self.image, str) or not self.image):
            raise TypeError(f"image must be a non-empty path string or None, got {self.image!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r} is not known; valid samplers: {', '.join(SAMPLERS)}")
        _integer("seed", self.seed, *SEED_RANGE)
        _integer("noise_seed", self.noise_seed, *SEED_RANGE, nullable=True)
        _integer("steps", self.steps, 1, MAX_STEPS)
        _number("guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE)
        if self.noise_level is None:  # the sampler's own: frozen, so set as dataclasses do
            object.__setattr__(self, "noise_level", 0.0 if self.sampler == "ode" else DEFAULT_NOISE_LEVEL)
        _number("noise_level", self.noise_level, 0.0, MAX_NOISE_LEVEL)
        _integer("height", self.height, 1, MAX_SIZE, nullable=True)
        _integer("width", self.width, 1, MAX_SIZE, nullable=True)
        _integer("frames", self.frames, 1, MAX_FRAMES, nullable=True)
        if self.sampler == "cps" and not self.noise_level < 1:
            raise ValueError(f"noise_level is CPS's eta and must be in [0, 1) for sampler='cps', "
                             f"got {self.noise_level}")
        self._check_audio()
        if self.negative_prompt and not self.guided:
            # The unconditional branch runs only under CFG: a negative prompt at scale 1 would change nothing.
            raise ValueError(f"negative_prompt={self.negative_prompt[:30]!r} is used only under classifier-free "
                             f"guidance, and guidance_scale={self.guidance_scale:g} runs none; set guidance_scale "
                             f"!= 1 (e.g. 4.5) or leave negative_prompt empty")
        _integer("start_step", self.start_step, 0, self.steps - 1)
        self._check_ode_ignores_noise()
        if self.sde_window is not None:
            window = self.sde_window
            if not (isinstance(window, (tuple, list)) and len(window) == 2
                    and all(isinstance(x, Integral) and not isinstance(x, bool) for x in window)):
                raise TypeError(f"sde_window must be a (start, end) pair of integers or None, got {window!r}")
            start, end = self.sde_window
            if not 0 <= start < end <= self.steps:
                raise ValueError(f"sde_window={self.sde_window} must satisfy 0 <= start < end <= steps={self.steps}")
        self._check_adaptive()

    def _check_ode_ignores_noise(self) -> None:
        """The ODE draws no noise and has no stochastic steps: a noise level or an SDE window would be ignored."""
        if self.sampler != "ode":
            return
        fix = "use sampler='sde' or 'cps', or leave it out"
        for name, value in (("noise_level", self.noise_level), ("audio_noise_level", self.audio_noise_level)):
            if value not in (None, 0):
                raise ValueError(f"{name}={value} with sampler='ode': the ODE draws no noise, so it would be "
                                 f"ignored; {fix}")
        if self.sde_window is not None:
            raise ValueError(f"sde_window={self.sde_window} with sampler='ode': the ODE has no stochastic steps, so "
                             f"it would be ignored; {fix}")

    def _check_adaptive(self) -> None:
        _number("cache_threshold", self.cache_threshold, 0.0, MAX_CACHE_THRESHOLD)
        _integer("cache_order", self.cache_order, 0, 1)
        if self.cache_order != 1 and self.cache_threshold == 0:  # only a skipped step reads it
            raise ValueError(f"cache_order={self.cache_order} applies to the steps cache_threshold skips, and "
                             "cache_threshold=0 skips none (early exit always reuses the last velocity); set "
                             "cache_threshold > 0 or leave cache_order at 1")
        if self.early_exit is not None:
            _number("early_exit", self.early_exit, 0.0, MAX_CACHE_THRESHOLD)
            if self.early_exit == 0:
                raise ValueError("early_exit=0 can never be met; valid: 0 < early_exit <= 1, or None for no early exit")
        window_end = self.sde_window[1] if self.sde_window is not None else self.steps
        if self.adaptive and self.sampler != "ode" and window_end >= self.steps:
            raise ValueError(f"cache_threshold / early_exit skip model calls only on the ODE steps after a rollout's "
                             f"SDE window (a trained step's log-prob needs its own model call), and "
                             f"sde_window={self.sde_window} with steps={self.steps} leaves none; valid: sampler='ode', "
                             f"an sde_window ending before steps, or cache_threshold=0 and early_exit=None")

    @property
    def guided(self) -> bool:
        """Whether the request runs classifier-free guidance (the video's scale, or a joint card's audio one, != 1)."""
        return self.guidance_scale != 1.0 or (self.audio and self.effective_audio_guidance != 1.0)

    @property
    def adaptive(self) -> bool:
        """Whether the request asks the adaptive loop to skip model calls (engine/adaptive.py)."""
        return self.cache_threshold > 0 or self.early_exit is not None

    def _check_audio(self) -> None:
        if not isinstance(self.audio, bool):
            raise TypeError(f"audio must be True or False, got {self.audio!r}")
        for name in ("audio_guidance_scale", "audio_noise_level"):
            if getattr(self, name) is not None and not self.audio:
                raise ValueError(f"{name}={getattr(self, name)!r} is set but audio=False: it applies to the audio "
                                 f"only; set audio=True or leave {name}=None")
        if self.audio_guidance_scale is not None:
            _number("audio_guidance_scale", self.audio_guidance_scale, 0.0, MAX_GUIDANCE)
        if self.audio_noise_level is not None:
            _number("audio_noise_level", self.audio_noise_level, 0.0, MAX_NOISE_LEVEL)
            if self.sampler == "cps" and not self.audio_noise_level < 1:
                raise ValueError(f"audio_noise_level is CPS's eta and must be in [0, 1) for sampler='cps', "
                                 f"got {self.audio_noise_level}")

    @property
    def effective_audio_guidance(self) -> float:
        """The audio's CFG scale: audio_guidance_scale, or guidance_scale when it is None or there is no audio."""
        return self.audio_guidance_scale if self.audio_guidance_scale is not None else self.guidance_scale

    @property
    def effective_audio_noise_level(self) -> float:
        """The audio's noise level: audio_noise_level (None = noise_level); 0 without audio (a card's hidden
        audio companion, ltx2's video-only path, steps deterministically)."""
        if not self.audio:
            return 0.0
        return self.audio_noise_level if self.audio_noise_level is not None else self.noise_level

    def batch_key(self) -> tuple:
        """Everything that must agree for two requests to share one batched loop."""
        return (self.card, self.steps, self.guidance_scale, self.sampler, self.noise_level,
                self.sde_window, self.height, self.width, self.frames, self.keep_trajectory,
                self.audio, self.audio_guidance_scale, self.audio_noise_level, self.start_step)


@dataclass
class Trajectory:
    """A batch of rollouts. Tensors stay on the engine's device until `to_host()`.

    latents    [B, T+1, *latent]  fp32, latents[:, 0] is the initial noise
    log_probs  [B, T]             fp32, log-prob of each taken step (0 for deterministic steps)
    timesteps  [T+1]              fp32, t from 1 (noise) to 0 (data); for ODE runs stepped by a folder's
                                  own scheduler, that scheduler's sigmas (UniPC starts at 1 - 1e-6)
    noise_levels [T]              fp32, the `a` used at each step (0 = ODE step); [B, T] when rows took
                                  different SDE windows (joined by `concat`), [T] again whenever every row
                                  agrees (`select`, `concat`); `levels_at(j)` reads step j either way
    prompt_embeds / pooled_prompt_embeds / prompt_mask: conditional branch
    negative_*: unconditional branch (None when guidance_scale == 1)
    condition_extra: per-row conditioning beyond the text (PromptEmbeds.extra), or None
    images     [B, C, H, W] in [0, 1] (videos [B, C, F, H, W])

    Joint audio+video cards (ltx2) pack each sample's latent as one flat fp32 vector [video | audio]; the
    last `audio_elements` entries are the audio latent (0 on every other card):
    audio_noise_levels [T] (or [B, T])  the audio elements' noise level at each step (0 = deterministic);
                       None when the latent has no audio part. `noise_levels` is then the video's.
    modality_log_probs {"video": [B, T], "audio": [B, T]}: each modality's step log-prob (mean over its
                       stochastic elements, 0 where it stepped deterministically); `log_probs` is the joint one,
                       the mean over the stochastic elements of both (engine.sampling.gaussian_step_log_prob)
    audio      [B, channels, samples] float in [-1, 1] (the audio VAE + vocoder's waveform) when audio was
               asked for, else None; audio_sample_rate its rate in Hz
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    noise_levels: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor | None
    negative_prompt_embeds: torch.Tensor | None
    negative_pooled_prompt_embeds: torch.Tensor | None
    negative_prompt_mask: torch.Tensor | None
    images: torch.Tensor
    prompts: list[str]
    seeds: list[int]
    card: str
    weight_version: int
    guidance_scale: float
    metadata: list[dict] = field(default_factory=list)
    # The sampler that took the steps: recompute log-probs with engine.sampling.step_log_prob(sampler, ...).
    sampler: str = "sde"
    condition_extra: dict[str, torch.Tensor] | None = None
    audio_noise_levels: torch.Tensor | None = None
    audio_elements: int = 0
    modality_log_probs: dict[str, torch.Tensor] | None = None
    audio: torch.Tensor | None = None
    audio_sample_rate: int | None = None
    # Model calls each row took [B] (int64): the step count, fewer where the adaptive loop reused a cached
    # velocity (engine/adaptive.py); None when the producer did not count them.
    steps_computed: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def cache_hit_rate(self) -> torch.Tensor | None:
        """Per row [B], the fraction of steps that reused a cached velocity instead of calling the model."""
        if self.steps_computed is None:
            return None
        return 1.0 - self.steps_computed.float() / self.num_steps

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def row_noise_levels(self) -> torch.Tensor:
        """The noise level of every row and step, [B, T]. With an audio part: the larger of the video's and
        the audio's, so a step is stochastic (positive transition std) where either modality is."""
        levels = _rows(self.noise_levels, len(self))
        if self.audio_noise_levels is None:
            return levels
        return torch.maximum(levels, _rows(self.audio_noise_levels, len(self)))

    def levels_at(self, j: int) -> torch.Tensor:
        """Step j's noise level: a scalar when every row shares it, else [B].

        With an audio part, per element: [1, N] when every row shares the levels, else [B, N] (video
        elements at the video's level, the last `audio_elements` at the audio's), which
        engine.sampling.step_log_prob takes as it takes a scalar (row 0 of the [1, N] form included).
        """
        if self.audio_noise_levels is None:
            return self.noise_levels[..., j]
        video, audio = self.noise_levels[..., j], self.audio_noise_levels[..., j]
        rows = 1 if video.dim() == 0 and audio.dim() == 0 else len(self)
        width = self.latents[0, 0].numel()
        out = torch.empty((rows, width), dtype=torch.float32, device=self.noise_levels.device)
        out[:, :width - self.audio_elements] = video.reshape(-1, 1)
        out[:, width - self.audio_elements:] = audio.reshape(-1, 1)
        return out

    def select(self, index: torch.Tensor | list[int] | slice) -> "Trajectory":
        """The sub-batch at `index` (batch-dimension tensors sliced, the rest shared)."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        elif isinstance(index, torch.Tensor):
            rows = index.tolist()
        else:
            rows = list(index)
        idx = torch.tensor(rows, dtype=torch.long, device=self.latents.device)
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "timesteps" or (f.name in LEVEL_FIELDS and (value is None or value.dim() == 1)):
                continue
            if f.name in LEVEL_FIELDS:
                changes[f.name] = _shared_levels(value.index_select(0, idx.to(value.device)))
            elif isinstance(value, torch.Tensor):
                changes[f.name] = value.index_select(0, idx.to(value.device))
            elif isinstance(value, dict):
                changes[f.name] = {k: v.index_select(0, idx.to(v.device)) for k, v in value.items()}
            elif isinstance(value, list) and len(value) == len(self):
                changes[f.name] = [value[i] for i in rows]
        return replace(self, **changes)

    @staticmethod
    def concat(parts: list["Trajectory"]) -> "Trajectory":
        """Join trajectories of one card, version, schedule, sampler and guidance along the batch.

        Parts may differ in their SDE windows (per-trajectory windows): the joined
        noise levels are then [B, T]; the flow times must be the same.
        """
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            if ((p.audio is None) != (first.audio is None) or p.audio_elements != first.audio_elements
                    or p.audio_sample_rate != first.audio_sample_rate):
                raise ValueError("Trajectory.concat needs parts that all have audio or all have none (with the same "
                                 "audio latent size and sample rate): generate audio and video-only rows apart")
            if (p.weight_version != first.weight_version or p.card != first.card
                    or p.num_steps != first.num_steps or p.sampler != first.sampler
                    or p.guidance_scale != first.guidance_scale):
                raise ValueError("Trajectory.concat needs parts with one card, weight version, step count, sampler "
                                 "and guidance scale")
            if not torch.equal(p.timesteps, first.timesteps):
                raise ValueError("Trajectory.concat needs parts with the same flow times (MixGRPO-Flash compresses "
                                 "each window's tail differently: its windows cannot be joined)")
        changes = {"noise_levels": _shared_levels(torch.cat([_rows(p.noise_levels, len(p)) for p in parts]))}
        if first.audio_noise_levels is not None:
            changes["audio_noise_levels"] = _shared_levels(torch.cat([_rows(p.audio_noise_levels, len(p))
                                                                      for p in parts]))
        for f in fields(first):
            value = getattr(first, f.name)
            if f.name == "timesteps" or f.name in LEVEL_FIELDS:
                continue
            if f.name == "steps_computed" and any(p.steps_computed is None for p in parts):
                changes[f.name] = None  # counted by some producers only: unknown for the whole
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = torch.cat([getattr(p, f.name) for p in parts])
            elif isinstance(value, dict):
                changes[f.name] = {k: torch.cat([getattr(p, f.name)[k] for p in parts]) for k in value}
            elif isinstance(value, list):
                changes[f.name] = [x for p in parts for x in getattr(p, f.name)]
        return replace(first, **changes)


LEVEL_FIELDS = ("noise_levels", "audio_noise_levels")  # [T] shared by every row, or [B, T]


def _rows(levels: torch.Tensor, batch: int) -> torch.Tensor:
    """[T] or [B, T] noise levels as [B, T]."""
    return levels if levels.dim() == 2 else levels.unsqueeze(0).expand(batch, -1)


def _shared_levels(levels: torch.Tensor) -> torch.Tensor:
    """[B, T] noise levels as one [T] row when every row agrees (the common case), else unchanged."""
    return levels[0] if bool((levels == levels[:1]).all()) else levels
