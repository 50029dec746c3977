"""Moved: the rollout layouts live in flywheel/recipe/rollouts.py, beside the `Rollouts` they serve (one module
for a reader following a step). This path re-exports them for one release."""

import warnings

from flywheel.recipe.rollouts import (  # noqa: F401
    Colocated,
    EngineProcess,
    INCOMPATIBLE,
    RayPool,
    SERVE_MODES,
    SwappedIn,
    WorkflowStage,
    _lora,
    active_options,
    check_layout_options,
    layout_refusals,
    make_layout,
)

warnings.warn("flywheel.recipe.layouts moved into flywheel.recipe.rollouts", DeprecationWarning, stacklevel=2)
