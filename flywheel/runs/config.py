"""Moved to `flywheel.config.parsing` (the parser lives with the sections and their checks in flywheel/config/);
this name keeps working for code written against it."""

from flywheel.config.parsing import *  # noqa: F401,F403
from flywheel.config.parsing import __all__  # noqa: F401
