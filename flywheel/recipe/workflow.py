"""RL through a workflow: `workflow.name=<id>` with `workflow.stage=<name>` trains one stage's card and scores the
workflow's final output.

The flywheel gets a `WorkflowStageEngine` (engine.workflows.runner): each generate runs the whole workflow,
the trained stage on the engine over the trained module (the recipe's sampler, its log-probs), every other
stage on the ODE without gradients, and hands back the trained stage's Trajectory with the final images.

The other stages run on models loaded afresh from their cards (the trained card's `model.path`, any other card's
`workflow.paths[card]`), so their weights are the card's whatever the trained module becomes, a resume
included: a stage on the trained card runs a frozen second copy of it (its memory once more), never the
trained module. Weight sync goes through the trained card's engine alone: only its version moves.
"""

from __future__ import annotations

import torch

from engine import Engine, load_model
from engine.workflows import WorkflowStageEngine, WorkflowRunner, default_registry, stage_paths
from flywheel.config.validation import check_workflow as check_workflow_keys  # noqa: F401 (its old home)


def workflow_stage_engine(cfg, trained: Engine, device: torch.device) -> WorkflowStageEngine:
    """The engine-like object the flywheel rolls out with when workflow.name is set (see the module docstring)."""
    registry = default_registry()
    paths = stage_paths(registry, cfg.workflow.name)
    folders = {**cfg.workflow.paths, cfg.model.card: cfg.model.path}
    frozen: dict[str, Engine] = {}
    for path, card in paths.items():
        if path != cfg.workflow.stage and card not in frozen:
            model = load_model(card, path=folders.get(card), device=device, dtype=getattr(torch, cfg.model.dtype))
            model.transformer.requires_grad_(False)
            frozen[card] = Engine(model, device=device, time_shift=cfg.sampling.time_shift)
    engines = {card: engine for card, engine in frozen.items() if card != trained.card_id}
    engines[trained.card_id] = trained
    stage_engines = {path: frozen[card] for path, card in paths.items()
                     if path != cfg.workflow.stage and card == trained.card_id}
    runner = WorkflowRunner(engines, registry=registry, stage_engines=stage_engines)
    return WorkflowStageEngine(runner, cfg.workflow.name, cfg.workflow.stage)
