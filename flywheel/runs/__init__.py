"""Runs: configs, the run directory, checkpoints, trackers, and `python -m flywheel.runs` (list, compare)."""
