"""Core types of the engine: what a caller asks for and what a rollout returns."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

SAMPLERS = ("ode", "sde", "cps")


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. Requests with the same `batch_key` run in one batch."""

    prompt: str
    seed: int
    negative_prompt: str = ""
    steps: int = 10
    guidance_scale: float = 1.0
    sampler: str = "sde"
    # Flow-SDE's `a` for "sde"; CPS's eta in [0, 1) for "cps"; unused by "ode".
    noise_level: float = 0.7
    # Half-open range [start, end) of step indices that are stochastic and
    # recorded; None means every step. Steps outside it are plain ODE steps.
    sde_window: tuple[int, int] | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    card: str = "toy-digits"
    keep_trajectory: bool = True
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r} is not known; valid samplers: {', '.join(SAMPLERS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")
        if self.sampler == "cps" and not self.noise_level < 1:
            raise ValueError(f"noise_level is CPS's eta and must be in [0, 1) for sampler='cps', "
                             f"got {self.noise_level}")
        if self.sde_window is not None:
            start, end = self.sde_window
            if not 0 <= start < end <= self.steps:
                raise ValueError(f"sde_window={self.sde_window} must satisfy 0 <= start < end <= steps={self.steps}")

    def batch_key(self) -> tuple:
        """Everything that must agree for two requests to share one batched loop."""
        return (self.card, self.steps, self.guidance_scale, self.sampler, self.noise_level,
                self.sde_window, self.height, self.width, self.frames, self.keep_trajectory)


@dataclass
class Trajectory:
    """A batch of rollouts. Tensors stay on the engine's device until `to_host()`.

    latents    [B, T+1, *latent]  fp32, latents[:, 0] is the initial noise
    log_probs  [B, T]             fp32, log-prob of each taken step (0 for deterministic steps)
    timesteps  [T+1]              fp32, t from 1 (noise) to 0 (data)
    noise_levels [T]              fp32, the `a` used at each step (0 = ODE step)
    prompt_embeds / pooled_prompt_embeds / prompt_mask: conditional branch
    negative_*: unconditional branch (None when guidance_scale == 1)
    images     [B, C, H, W] in [0, 1] (videos [B, C, F, H, W])
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

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

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
            if f.name in ("timesteps", "noise_levels"):
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = value.index_select(0, idx.to(value.device))
            elif isinstance(value, list) and len(value) == len(self):
                changes[f.name] = [value[i] for i in rows]
        return replace(self, **changes)

    @staticmethod
    def concat(parts: list["Trajectory"]) -> "Trajectory":
        """Join trajectories of one batch key (same steps, card and version) along the batch."""
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            if p.weight_version != first.weight_version or p.card != first.card or p.num_steps != first.num_steps:
                raise ValueError("Trajectory.concat needs parts with one card, step count and weight version")
        changes = {}
        for f in fields(first):
            value = getattr(first, f.name)
            if f.name in ("timesteps", "noise_levels"):
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = torch.cat([getattr(p, f.name) for p in parts])
            elif isinstance(value, list):
                changes[f.name] = [x for p in parts for x in getattr(p, f.name)]
        return replace(first, **changes)
