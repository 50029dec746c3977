"""Scale-out past one machine: rollout replicas and reward workers on Ray (the optional `ray` extra).

`flywheel.scale.config` imports without Ray; `ray_pool`, `ray_rewards` and `ray_sync` need it.
"""

from flywheel.scale.config import RolloutConfig, build_rewards, build_rollout_engine

__all__ = ["RolloutConfig", "build_rewards", "build_rollout_engine"]
