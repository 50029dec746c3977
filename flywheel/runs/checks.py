"""Moved to `flywheel.config.validation` (the checks live with the parser and the sections in flywheel/config/);
this name keeps working for code written against it."""

from flywheel.config.validation import ConfigChecks, config_value, non_finite_fields  # noqa: F401
