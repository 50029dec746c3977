"""Moved: `swapped_in` lives in flywheel/recipe/policy.py (issue 24: one file fewer on a step's path); this
module re-exports it for one release."""

from flywheel.recipe.policy import swapped_in  # noqa: F401

__all__ = ["swapped_in"]
