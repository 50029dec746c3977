"""RL through a workflow: `model.workflow=<id>` with `train.stage=<name>` trains one stage's card and scores the
workflow's final output.

The flywheel gets a `WorkflowStageEngine` (engine.workflows.runner): each generate runs the whole workflow,
the trained stage on the engine over the trained module (the recipe's sampler, its log-probs), every other
stage on the ODE without gradients, and hands back the trained stage's Trajectory with the final images.

The other stages run on models loaded afresh from their cards (the trained card's `model.path`, any other card's
`model.workflow_paths[card]`), so their weights are the card's whatever the trained module becomes, a resume
included: a stage on the trained card runs a frozen second copy of it (its memory once more), never the
trained module. Weight sync goes through the trained card's engine alone: only its version moves.
"""

from __future__ import annotations

import torch

from engine import Engine, load_model
from engine.workflows import WorkflowStageEngine, WorkflowRunner, default_registry, stage_paths
from flywheel.runs.checks import ConfigChecks


def check_workflow_keys(cfg, checks: ConfigChecks) -> None:
    """model.workflow names a registered workflow, train.stage its first card stage on model.card; neither
    key without the other; no engine process (its stages run in this one)."""
    workflow_id, stage = cfg.model.workflow, getattr(cfg.train, "stage", None)
    if workflow_id is None:
        if stage is not None:
            checks.fail(f"train.stage={stage!r} names a stage of a workflow, but model.workflow is null; set "
                        f"model.workflow to one of: {', '.join(default_registry().ids())}")
        if cfg.model.workflow_paths:
            checks.fail("model.workflow_paths is set but model.workflow is null: it gives the folders of a "
                        "workflow's other cards")
        return
    registry = default_registry()
    try:
        paths = stage_paths(registry, workflow_id)
    except (KeyError, ValueError) as e:
        checks.fail(f"model.workflow={workflow_id!r}: {str(e).strip(chr(34))}")
        return
    if stage not in paths:
        checks.fail(f"train.stage={stage!r}: name the stage of {workflow_id!r} to train; its card stages, in the "
                    f"order they run: {', '.join(f'{p} ({c})' for p, c in paths.items())}")
        return
    first = next(iter(paths))
    if stage != first:
        checks.fail(f"train.stage={stage!r}: only the first stage to run ({first!r}) can be trained; a later stage "
                    f"starts from another stage's output, which the trainer does not regenerate")
    if paths[stage] != cfg.model.card:
        checks.fail(f"model.card={cfg.model.card!r}: stage {stage!r} of {workflow_id!r} runs card "
                    f"{paths[stage]!r}; set model.card={paths[stage]}")
    unknown = sorted(set(cfg.model.workflow_paths) - set(paths.values()))
    if unknown:
        checks.fail(f"model.workflow_paths names card(s) {', '.join(unknown)} that {workflow_id!r} does not run; "
                    f"its cards: {', '.join(sorted(set(paths.values())))}")


def workflow_stage_engine(cfg, trained: Engine, device: torch.device) -> WorkflowStageEngine:
    """The engine-like object the flywheel rolls out with when model.workflow is set (see the module docstring)."""
    registry = default_registry()
    paths = stage_paths(registry, cfg.model.workflow)
    folders = {**cfg.model.workflow_paths, cfg.model.card: cfg.model.path}
    frozen: dict[str, Engine] = {}
    for path, card in paths.items():
        if path != cfg.train.stage and card not in frozen:
            model = load_model(card, path=folders.get(card), device=device, dtype=getattr(torch, cfg.model.dtype))
            model.transformer.requires_grad_(False)
            frozen[card] = Engine(model, device=device, time_shift=cfg.sampling.time_shift)
    engines = {card: engine for card, engine in frozen.items() if card != trained.card_id}
    engines[trained.card_id] = trained
    stage_engines = {path: frozen[card] for path, card in paths.items()
                     if path != cfg.train.stage and card == trained.card_id}
    runner = WorkflowRunner(engines, registry=registry, stage_engines=stage_engines)
    return WorkflowStageEngine(runner, cfg.model.workflow, cfg.train.stage)
