"""Running a workflow on a set of Engines (one per card), and a trained stage seen as one engine.

`WorkflowRunner.run(workflow_id, requests)` runs every stage as one batched
`Engine.generate` call: a stage's requests are the workflow's with the stage's
card and `overrides` (then the caller's `stage_overrides`) applied, and its
input built from the previous stage's images (see engine.workflows.definition).
The output carries the final images, the last stage's Trajectory, the weight
version of every engine that contributed, and, with `intermediates=True`,
every stage's result under its dotted path ("first.refine" inside a nested stage).

A workflow running itself is refused at registration; the runner also keeps
the chain of workflows running in this context, and one that is entered again
(a builder that changed after registration) raises WorkflowCycleError.

`WorkflowStageEngine` is what RL through a workflow hands the flywheel: an
engine-like object whose `generate(requests)` runs the workflow with the
trained stage on the trained card's Engine (its own sampler: log-probs) and
every other stage on the ODE, and returns the trained stage's Trajectory with
`images` replaced by the workflow's final output, so recipes stay unchanged.
"""

from __future__ import annotations

import contextvars
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.engine import Engine
from engine.types import GenerationRequest, Trajectory, overlay_request_fields
from engine.workflows.definition import (FirstFrame, FromImage, FromText, Stage, WorkflowCycleError, WorkflowError,
                                         WorkflowRegistry, default_registry)

_RUNNING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("running_workflows", default=())


@dataclass
class StageResult:
    """One stage's output: its images ([B, C, H, W] or videos), Trajectory, card and weight version."""

    path: str
    card: str
    images: torch.Tensor
    trajectory: Trajectory
    weight_version: int


@dataclass
class WorkflowOutput:
    """A workflow's final images and Trajectory, the weight version of every contributing engine, and (on
    request) every stage's result by dotted path.

    `weight_versions` is keyed by card; a stage on its own engine, or one that ran on a newer version than an
    earlier stage on the same engine (a weight load landed between them), is keyed "<card>@<stage path>"."""

    workflow: str
    images: torch.Tensor
    trajectory: Trajectory
    weight_versions: dict[str, int]
    stages: dict[str, StageResult] = field(default_factory=dict)


def image_latents(model, images: torch.Tensor) -> torch.Tensor:
    """The clean latents of images [B, C, H, W] in [0, 1] for an image-to-image stage on `model`.

    Through the model's `encode_image(images)` (the toy cards: 2·image - 1, the inverse of their decode).
    """
    if hasattr(model, "encode_image"):
        return model.encode_image(images)
    raise WorkflowError(f"card {model.card_id!r} cannot take an image-to-image stage: its model has no "
                        f"encode_image(images) -> latents (the toy cards and models with one can)")


def save_first_frames(images: torch.Tensor, folder: Path) -> list[str]:
    """Write images [B, C, H, W] in [0, 1] as PNGs (what an image-conditioned card reads); their paths."""
    from PIL import Image

    paths = []
    for i, image in enumerate(images):
        array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
        rgb = array.expand(3, -1, -1) if array.shape[0] == 1 else array[:3]
        path = folder / f"frame{i}.png"
        Image.fromarray(rgb.permute(1, 2, 0).contiguous().numpy(), mode="RGB").save(path)
        paths.append(str(path))
    return paths


class WorkflowRunner:
    """Runs registered workflows on `engines` (card id -> Engine).

    `stage_engines` (stage path -> Engine) puts one stage on another engine of its card (RL: a frozen
    copy for the stage that is not trained); `stage_overrides` (stage path -> request fields) change
    one stage's requests for this runner (RL: the ODE on every stage but the trained one).
    """

    def __init__(self, engines: dict[str, Engine], registry: WorkflowRegistry | None = None,
                 stage_engines: dict[str, Engine] | None = None, stage_overrides: dict[str, dict] | None = None):
        self.engines = dict(engines)
        self.registry = registry or default_registry()
        self.stage_engines = dict(stage_engines or {})
        self.stage_overrides = dict(stage_overrides or {})

    def run(self, workflow_id: str, requests: list[GenerationRequest], intermediates: bool = False) -> WorkflowOutput:
        """Run `workflow_id` on `requests` (their `card` is ignored: each stage sets its own)."""
        if not requests:
            raise ValueError("a workflow run needs at least one request")
        self.registry.check_namespace()
        workflow = self.registry.get(workflow_id)
        workflow.validate(self.engines)
        stages: dict[str, StageResult] = {}
        versions: dict[str, int] = {}
        last = self._run_workflow(workflow_id, requests, None, "", stages, versions)
        return WorkflowOutput(workflow_id, last.images, last.trajectory, versions,
                              stages if intermediates else {})

    def _run_workflow(self, workflow_id: str, requests: list[GenerationRequest], previous: StageResult | None,
                      prefix: str, stages: dict, versions: dict) -> StageResult:
        chain = _RUNNING.get()
        if workflow_id in chain:
            raise WorkflowCycleError(f"workflow {workflow_id!r} re-entered itself at run time: "
                                     f"{' -> '.join(chain + (workflow_id,))}")
        token = _RUNNING.set(chain + (workflow_id,))
        try:
            for stage in self.registry.get(workflow_id).stages:
                path = prefix + stage.name
                if self.registry.is_workflow(stage.target):
                    previous = self._run_workflow(stage.target, requests, previous, path + ".", stages, versions)
                else:
                    previous = self._run_stage(stage, path, requests, previous, versions)
                    stages[path] = previous
            return previous
        finally:
            _RUNNING.reset(token)

    def engine_for(self, stage: Stage, path: str) -> Engine:
        engine = self.stage_engines.get(path) or self.engines.get(stage.target)
        if engine is None:
            raise WorkflowError(f"stage {path!r} needs card {stage.target!r}; engines: {', '.join(self.engines)}")
        return engine

    def _run_stage(self, stage: Stage, path: str, requests: list[GenerationRequest],
                   previous: StageResult | None, versions: dict) -> StageResult:
        engine = self.engine_for(stage, path)
        rows = stage_requests(stage, requests, self.stage_overrides.get(path))
        if not isinstance(stage.input, FromText) and previous is None:
            raise WorkflowError(f"stage {path!r} starts from the previous stage's images, but it runs first")
        if isinstance(stage.input, FromImage):
            with torch.no_grad():
                latents = image_latents(engine.model, previous.images.to(engine.device))
            trajectory = engine.generate(rows, init_latents=latents)
        elif isinstance(stage.input, FirstFrame):
            # PNG files: the image-to-video card reads first frames by path as its users give them, through
            # the same loader and resize as the stock pipeline (8-bit, as any saved image would be).
            with tempfile.TemporaryDirectory(prefix="workflow-frames-") as folder:
                paths = save_first_frames(previous.images, Path(folder))
                trajectory = engine.generate([replace(r, image=p) for r, p in zip(rows, paths)])
        else:
            trajectory = engine.generate(rows)
        key = stage.target if engine is self.engines.get(stage.target) else f"{stage.target}@{path}"
        if versions.get(key, trajectory.weight_version) != trajectory.weight_version:
            # A weight load landed between two stages on one engine: both versions stay on record.
            key = f"{stage.target}@{path}"
        versions[key] = trajectory.weight_version
        return StageResult(path, stage.target, trajectory.images, trajectory, trajectory.weight_version)


class WorkflowStageEngine:
    """The trained stage of a workflow as an engine: `generate(requests)` runs the whole workflow and returns
    the trained stage's Trajectory (its log-probs, its card, its weight version) whose `images` are the
    workflow's final output, which the rewards then score.

    Every other stage samples the ODE (no log-probs are recorded or used there) on its own engine. Only the
    first stage to run may be trained: a later stage's log-probs would be conditioned on images the
    trainer does not regenerate, and refinement stages run fewer steps than the rollout config says.
    """

    def __init__(self, runner: WorkflowRunner, workflow_id: str, stage: str):
        self.runner, self.workflow_id, self.stage = runner, workflow_id, stage
        paths = stage_paths(runner.registry, workflow_id)
        if stage not in paths:
            raise WorkflowError(f"workflow {workflow_id!r} has no card stage {stage!r}; its stages, in the order "
                                f"they run: {', '.join(paths)}")
        first = next(iter(paths))
        if stage != first:
            raise WorkflowError(f"training stage {stage!r} of {workflow_id!r} is not supported: only the first stage "
                                f"to run ({first!r}) can be trained (a later stage starts from another stage's "
                                f"output, which the trainer does not regenerate)")
        card = paths[stage]
        self.engine = runner.engines[card]
        for path in paths:
            if path != stage:  # no log-probs there: the deterministic ODE, whatever the rollout's sampler
                runner.stage_overrides[path] = {**runner.stage_overrides.get(path, {}), "sampler": "ode",
                                                "sde_window": None}

    @property
    def card_id(self) -> str:
        return self.engine.card_id

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def model(self):
        return self.engine.model

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def generate(self, requests: list[GenerationRequest]) -> Trajectory:
        out = self.runner.run(self.workflow_id, requests, intermediates=True)
        trained = out.stages[self.stage].trajectory
        return replace(trained, images=out.images)


def stage_plan(registry: WorkflowRegistry, workflow_id: str, prefix: str = "",
               chain: tuple[str, ...] = ()) -> dict[str, Stage]:
    """Every card stage of a workflow, nested ones by dotted path, in the order they run: path -> Stage."""
    if workflow_id in chain:
        raise WorkflowCycleError(f"workflow {workflow_id!r} reaches itself: {' -> '.join(chain + (workflow_id,))}")
    plan: dict[str, Stage] = {}
    for stage in registry.get(workflow_id).stages:
        if registry.is_workflow(stage.target):
            plan.update(stage_plan(registry, stage.target, prefix + stage.name + ".", chain + (workflow_id,)))
        else:
            plan[prefix + stage.name] = stage
    return plan


def stage_paths(registry: WorkflowRegistry, workflow_id: str) -> dict[str, str]:
    """Every card stage's dotted path -> its card, in the order they run."""
    return {path: stage.target for path, stage in stage_plan(registry, workflow_id).items()}


def stage_requests(stage: Stage, requests: list[GenerationRequest],
                   extra: dict | None = None) -> list[GenerationRequest]:
    """A stage's requests: the workflow's with the stage's card, its overrides, then `extra`, and the start step
    of an image-to-image stage."""
    fields = overlay_request_fields({}, {"card": stage.target, **stage.overrides, **(extra or {})})
    out = [replace(r, **fields) for r in requests]
    if isinstance(stage.input, FromImage):
        out = [replace(r, start_step=stage.input.start_step(r.steps)) for r in out]
    return out
