"""Workflows: model cards composed into one servable, addressed by a dotted id in the cards' namespace.

A `Workflow` is a sequence of `Stage`s. Each stage names a card (`toy-digits`,
`sd3`, `wan2.1-i2v`) or another workflow (nesting), and says how its input is
built from the previous stage's output (`StageInput`: the text of the request,
the previous images as the start of an image-to-image refinement, or the
previous images as first frames of an image-to-video card). A stage's `overrides` are
request fields it always uses (a refine stage samples the ODE, an image stage
asks for no frames).

The `WorkflowRegistry` maps ids to builders (a callable returning the
Workflow), so adding a pipeline is one line of `CATALOG`. Registration fails
fast: the id must be dotted and not a card id, every stage target must be a
registered card or an already registered workflow, and no workflow may reach
itself through its stages (a direct cycle or one through nesting, which
re-registering with `replace=True` could create). Each stage is checked as
well: a plain name (a dot would collide with a nested stage's dotted path), an
input of the three kinds, a first stage that generates from text, override
fields a request has and the runner does not set itself, an image-to-video
input only into a card that takes first frames (and such a card only from
one), and no input or overrides on a stage that runs a workflow (the nested
workflow's own stages say those). A builder is called again
whenever the workflow is looked up, so one that changes its answer after
registration is caught at run time by the runner's re-entry guard
(engine.workflows.runner).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from engine.cards import list_cards

WORKFLOW_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+$")
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# Request fields the runner sets on a stage's requests itself: the card from the stage's target, the first frame
# from the previous stage's images, the start step from the stage's FromImage strength.
RUNNER_FIELDS = ("card", "image", "start_step")


class WorkflowError(ValueError):
    """A workflow that cannot be registered or run as defined."""


class MissingCardsError(WorkflowError):
    """A workflow needs cards that are not available; `missing` lists them."""

    def __init__(self, workflow_id: str, missing: list[str], available: list[str]):
        self.missing = missing
        super().__init__(f"workflow {workflow_id!r} needs card(s) {', '.join(missing)} that are not available; "
                         f"available: {', '.join(available) or '(none)'}")


class WorkflowCycleError(WorkflowError):
    """A workflow that would run itself (at registration, or re-entered at run time)."""


@dataclass(frozen=True)
class FromText:
    """The stage generates from the workflow's requests themselves (text-to-image, text-to-video)."""

    kind: str = field(default="text", init=False)


@dataclass(frozen=True)
class FromImage:
    """Image-to-image (SDEdit) from the previous stage's images: each is encoded to a latent, noised to the
    flow time of step `start_step = steps - round(strength·steps)` with the request's seed, and denoised from
    there. strength 1 would be pure noise (the image ignored), 0 nothing to do: (0, 1) exclusive."""

    strength: float = 0.5
    kind: str = field(default="image", init=False)

    def __post_init__(self):
        if not 0.0 < self.strength < 1.0:
            raise WorkflowError(f"FromImage(strength={self.strength}) must be in (0, 1): the fraction of the "
                                f"schedule re-run from the noised image")

    def start_step(self, steps: int) -> int:
        """The step the refinement starts at; at least 1 (0 is pure noise) and at most steps - 1."""
        if steps < 2:  # no step can start a refinement: 0 is pure noise and steps - 1 < 1
            raise WorkflowError(f"an image-to-image stage (FromImage(strength={self.strength})) needs steps >= 2 "
                                f"to re-run part of the schedule from the noised image; got steps={steps}")
        return min(max(steps - round(self.strength * steps), 1), steps - 1)


@dataclass(frozen=True)
class FirstFrame:
    """Image-to-video: the previous stage's images are the first frames of an image-conditioned card."""

    kind: str = field(default="first_frame", init=False)


StageInput = FromText | FromImage | FirstFrame


@dataclass(frozen=True)
class Stage:
    """One step of a workflow: `target` is a card id or a workflow id; `overrides` are request fields it fixes."""

    name: str
    target: str
    input: StageInput = FromText()
    overrides: dict = field(default_factory=dict, hash=False)

    def describe(self) -> dict:
        return {"name": self.name, "target": self.target, "input": self.input.kind,
                "overrides": {k: v for k, v in self.overrides.items() if isinstance(v, (int, float, str, bool))}}


@dataclass(frozen=True)
class Workflow:
    """A dotted id, a description and its stages; `registry` (set when looked up) resolves nested ids."""

    id: str
    description: str
    stages: tuple[Stage, ...]
    registry: "WorkflowRegistry | None" = field(default=None, compare=False, repr=False)

    @property
    def requires(self) -> tuple[str, ...]:
        """Every card the workflow runs, nested workflows' included, sorted."""
        return tuple(sorted(self._cards(())))

    def _cards(self, chain: tuple[str, ...]) -> set[str]:
        if self.id in chain:  # only a builder that changed after registration gets here
            raise WorkflowCycleError(f"workflow {self.id!r} reaches itself: {' -> '.join(chain + (self.id,))}")
        cards: set[str] = set()
        for stage in self.stages:
            if self.registry is not None and self.registry.is_workflow(stage.target):
                cards.update(self.registry.get(stage.target)._cards(chain + (self.id,)))
            else:
                cards.add(stage.target)
        return cards

    def validate(self, available_cards) -> None:
        """MissingCardsError naming every required card not in `available_cards`."""
        available = sorted(available_cards)
        missing = [c for c in self.requires if c not in available]
        if missing:
            raise MissingCardsError(self.id, missing, available)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"workflow {self.id!r} has no stage {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def describe(self) -> dict:
        return {"id": self.id, "kind": "workflow", "description": self.description,
                "requires": list(self.requires), "stages": [s.describe() for s in self.stages]}


class WorkflowRegistry:
    """Workflow ids -> builders, checked against the card ids (`cards()`, default the registered cards)."""

    def __init__(self, cards: Callable[[], list[str]] = list_cards):
        self._cards = cards
        self._builders: dict[str, Callable[[], Workflow]] = {}

    def ids(self) -> list[str]:
        return sorted(self._builders)

    def is_workflow(self, target: str) -> bool:
        return target in self._builders

    def get(self, workflow_id: str) -> Workflow:
        """The workflow `workflow_id`, freshly built, resolving its nested ids through this registry."""
        builder = self._builders.get(workflow_id)
        if builder is None:
            raise KeyError(f"unknown workflow {workflow_id!r}; workflows: {', '.join(self.ids()) or '(none)'}")
        return self._build(workflow_id, builder)

    def register(self, workflow_id: str, builder: Callable[[], Workflow], replace: bool = False) -> Workflow:
        """Add `builder` under `workflow_id` after checking the id, the stage targets and cycles."""
        if not WORKFLOW_ID.match(workflow_id):
            raise WorkflowError(f"workflow id {workflow_id!r} must be dotted lowercase words, e.g. "
                                f"'toy.digits_then_refine' (card ids have no dot)")
        cards = set(self._cards())
        if workflow_id in cards:
            raise WorkflowError(f"workflow id {workflow_id!r} is a card id: workflows and cards share one namespace")
        if workflow_id in self._builders and not replace:
            raise WorkflowError(f"workflow {workflow_id!r} is already registered; pass replace=True to swap it")
        workflow = self._build(workflow_id, builder)
        names = [s.name for s in workflow.stages]
        if not names or len(set(names)) != len(names):
            raise WorkflowError(f"workflow {workflow_id!r} needs at least one stage and unique stage names, "
                                f"got {names}")
        for index, stage in enumerate(workflow.stages):
            if stage.target == workflow_id:
                raise WorkflowCycleError(f"workflow {workflow_id!r}: stage {stage.name!r} runs the workflow itself")
            if stage.target not in cards and stage.target not in self._builders:
                raise WorkflowError(f"workflow {workflow_id!r}: stage {stage.name!r} targets {stage.target!r}, "
                                    f"which is neither a card nor a registered workflow; cards: "
                                    f"{', '.join(sorted(cards))}; workflows: {', '.join(self.ids()) or '(none)'}")
            check_stage(workflow_id, stage, first=index == 0, nested=stage.target in self._builders)
        for stage in workflow.stages:
            if stage.target in self._builders:
                path = self._path_to(stage.target, workflow_id, [workflow_id, stage.target])
                if path:
                    raise WorkflowCycleError(f"workflow {workflow_id!r} would run itself through nesting: "
                                             f"{' -> '.join(path)}")
        self._builders[workflow_id] = builder
        return workflow

    def check_namespace(self) -> None:
        """WorkflowError if a card registered after a workflow took its id (engine.cards cannot check it)."""
        clash = sorted(set(self._builders) & set(self._cards()))
        if clash:
            raise WorkflowError(f"id(s) {', '.join(clash)} name both a card and a workflow; rename one")

    def _build(self, workflow_id: str, builder: Callable[[], Workflow]) -> Workflow:
        workflow = builder()
        if not isinstance(workflow, Workflow) or workflow.id != workflow_id:
            raise WorkflowError(f"the builder of {workflow_id!r} must return a Workflow with that id, "
                                f"got {getattr(workflow, 'id', workflow)!r}")
        return Workflow(workflow.id, workflow.description, tuple(workflow.stages), registry=self)

    def _path_to(self, current: str, goal: str, path: list[str]) -> list[str] | None:
        """The chain of workflow ids from `current` that reaches `goal`, or None (depth-first)."""
        for stage in self._build(current, self._builders[current]).stages:
            if stage.target == goal:
                return path + [goal]
            if stage.target in self._builders and stage.target not in path:
                found = self._path_to(stage.target, goal, path + [stage.target])
                if found:
                    return found
        return None


def check_stage(workflow_id: str, stage: Stage, first: bool, nested: bool) -> None:
    """WorkflowError naming what is wrong with `stage` as defined (registration; no card is loaded)."""
    where = f"workflow {workflow_id!r}: stage {stage.name!r}"
    if not isinstance(stage.name, str) or not STAGE_NAME.match(stage.name):
        raise WorkflowError(f"workflow {workflow_id!r}: stage name {stage.name!r} must be letters, digits, '_' or "
                            f"'-' (no dot: a nested stage's results are keyed by the dotted path 'stage.inner')")
    if not isinstance(stage.input, (FromText, FromImage, FirstFrame)):
        raise WorkflowError(f"{where} has input {stage.input!r}; valid: FromText(), FromImage(strength), "
                            f"FirstFrame()")
    if not isinstance(stage.overrides, dict):
        raise WorkflowError(f"{where} has overrides {stage.overrides!r}; valid: a dict of request fields")
    if nested:
        # The nested workflow's first stage generates from text and sets its own fields: these would be ignored.
        if not isinstance(stage.input, FromText) or stage.overrides:
            raise WorkflowError(f"{where} runs workflow {stage.target!r}, which takes no input or overrides "
                                f"(got input {stage.input.kind!r}, overrides {sorted(stage.overrides)}); set them "
                                f"on {stage.target!r}'s own stages")
        return
    if first and not isinstance(stage.input, FromText):
        raise WorkflowError(f"{where} runs first, so it cannot start from a previous stage's images "
                            f"(input {stage.input.kind!r}); the first stage must be FromText()")
    _check_overrides(where, stage.overrides)
    conditioned = _image_conditioned(stage.target)
    if conditioned is False and isinstance(stage.input, FirstFrame):
        raise WorkflowError(f"{where}: card {stage.target!r} takes no first frame, so FirstFrame() cannot feed it; "
                            f"use FromImage(strength) to refine the images, or an image-conditioned card")
    if conditioned and not isinstance(stage.input, FirstFrame):
        raise WorkflowError(f"{where}: card {stage.target!r} needs a conditioning image on every request, so its "
                            f"input must be FirstFrame() (got {stage.input.kind!r})")


def _check_overrides(where: str, overrides: dict) -> None:
    from dataclasses import fields, replace

    from engine.types import GenerationRequest, overlay_request_fields

    valid = sorted(f.name for f in fields(GenerationRequest) if f.name not in RUNNER_FIELDS)
    for name in overrides:
        if name in RUNNER_FIELDS:
            raise WorkflowError(f"{where} overrides {name!r}, which the runner sets from the stage itself "
                                f"({', '.join(RUNNER_FIELDS)}: its target, its input)")
        if name not in valid:
            raise WorkflowError(f"{where} overrides unknown request field {name!r}; valid: {', '.join(valid)}")
    try:  # the request's own checks on the values (a sampler name, a noise level), before anything runs
        replace(GenerationRequest(prompt="check", seed=0), **overlay_request_fields({}, overrides))
    except (TypeError, ValueError) as err:
        raise WorkflowError(f"{where} has overrides that no request takes: {err}") from None


def _image_conditioned(target: str) -> bool | None:
    """Whether a registered card needs a conditioning image per request (its defaults say); None for an id the
    card registry does not hold (a registry checked against other ids, as in tests)."""
    from engine.cards import get_card

    try:
        return bool(get_card(target).defaults.get("image_conditioned", False))
    except KeyError:
        return None


# ---- the catalog: one line per workflow ------------------------------------------------------

def _digits_then_refine() -> Workflow:
    # strength 0.3, a light touch: re-running half the schedule (0.5) on the base card keeps less of the drawn digit
    # (an image scoring 0.92 keeps 0.78 at 0.5, 0.85 at 0.3: digit_alignment, held-out prompts, guidance 3).
    return Workflow("toy.digits_then_refine", "toy-digits draws the digit from the prompt, then refines its "
                    "image: SDEdit on the same card over the last 30% of the schedule (ODE).",
                    (Stage("draw", "toy-digits"),
                     Stage("refine", "toy-digits", FromImage(strength=0.3), {"sampler": "ode", "sde_window": None})))


def _refine_twice() -> Workflow:
    return Workflow("toy.refine_twice", "toy.digits_then_refine, then one more SDEdit refinement (the last 20% "
                    "of the schedule): a nested workflow.",
                    (Stage("first", "toy.digits_then_refine"),
                     Stage("again", "toy-digits", FromImage(strength=0.2), {"sampler": "ode", "sde_window": None})))


def _t2i_i2v() -> Workflow:
    return Workflow("image_video.t2i_i2v", "SD3 text-to-image, then Wan2.1 image-to-video from that image "
                    "(the request's frames are the video's).",
                    (Stage("image", "sd3", FromText(), {"frames": None}),
                     Stage("video", "wan2.1-i2v", FirstFrame())))


CATALOG: dict[str, Callable[[], Workflow]] = {
    "toy.digits_then_refine": _digits_then_refine,
    "toy.refine_twice": _refine_twice,
    "image_video.t2i_i2v": _t2i_i2v,
}

_DEFAULT: WorkflowRegistry | None = None


def default_registry() -> WorkflowRegistry:
    """The process-wide registry holding CATALOG (registered in order, so nested ids come first)."""
    global _DEFAULT
    if _DEFAULT is None:
        registry = WorkflowRegistry()
        for workflow_id, builder in CATALOG.items():
            registry.register(workflow_id, builder)
        _DEFAULT = registry
    return _DEFAULT
