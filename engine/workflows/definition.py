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
re-registering with `replace=True` could create). A builder is called again
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
        for stage in workflow.stages:
            if stage.target == workflow_id:
                raise WorkflowCycleError(f"workflow {workflow_id!r}: stage {stage.name!r} runs the workflow itself")
            if stage.target not in cards and stage.target not in self._builders:
                raise WorkflowError(f"workflow {workflow_id!r}: stage {stage.name!r} targets {stage.target!r}, "
                                    f"which is neither a card nor a registered workflow; cards: "
                                    f"{', '.join(sorted(cards))}; workflows: {', '.join(self.ids()) or '(none)'}")
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
