"""flywheel's orchestration: the rollout-reward-update loop, advantages, weight sync, configs, runs."""
