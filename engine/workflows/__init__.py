"""Workflows: cards composed into one servable (definition and registry, runner). See definition.py."""

from engine.workflows.definition import (CATALOG, FirstFrame, FromImage, FromText, MissingCardsError, Stage,
                                         Workflow, WorkflowCycleError, WorkflowError, WorkflowRegistry,
                                         default_registry)
from engine.workflows.runner import (StageResult, WorkflowOutput, WorkflowRunner, WorkflowStageEngine, image_latents,
                                     stage_plan, stage_paths, stage_requests)

__all__ = [
    "CATALOG", "FirstFrame", "FromImage", "FromText", "MissingCardsError", "Stage", "StageResult", "Workflow",
    "WorkflowCycleError", "WorkflowError", "WorkflowOutput", "WorkflowRegistry", "WorkflowRunner",
    "WorkflowStageEngine", "default_registry", "image_latents", "stage_paths",
    "stage_plan", "stage_requests",
]
