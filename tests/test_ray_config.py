"""RolloutConfig checks and the local side of build_rollout_engine / build_rewards (no Ray needed)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from engine import GenerationRequest, load_model
from flywheel.scale import RolloutConfig, build_rewards, build_rollout_engine
from flywheel.scale.config import replicas_of_rank
from rewards import RewardSet


@pytest.mark.parametrize("field, value, message", [
    ("backend", "slurm", "valid backends are local, ray"),
    ("replicas", 0, "replicas must be >= 1"),
    ("cpus_per_replica", -1.0, "cpus_per_replica and rollout.gpus_per_replica must be >= 0"),
    ("max_failures", -1, "max_failures and rollout.reward_actors must be >= 0"),
    ("gpus_per_reward_actor", -0.5, "gpus_per_reward_actor must be >= 0"),
    ("sync_backend", "mpi", "valid are object_store, nccl, gloo"),
])
def test_bad_rollout_settings_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{field: value})


def test_the_section_reads_as_an_omegaconf_structured_config():
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RolloutConfig),
                                              OmegaConf.from_dotlist(["backend=ray", "replicas=4", "address=auto"])))
    assert cfg == RolloutConfig(backend="ray", replicas=4, address="auto")


def test_each_rank_drives_an_equal_share_of_the_replicas():
    assert replicas_of_rank(RolloutConfig(replicas=4), world=2) == 2
    assert replicas_of_rank(RolloutConfig(replicas=3), world=1) == 3
    with pytest.raises(ValueError, match="replicas=3 must be divisible by the number of trainer processes \\(2\\)"):
        replicas_of_rank(RolloutConfig(replicas=3), world=2)


def test_local_backend_is_an_engine_synced_from_the_initial_weights():
    state = load_model("toy-digits").transformer.state_dict()
    weights = {n: t * 1.01 if t.is_floating_point() else t for n, t in state.items()}
    engine, controller = build_rollout_engine(RolloutConfig(), "toy-digits", weight_version=0, initial_weights=weights)
    assert engine.weight_version == 1 and controller.mode == "copy"
    assert all(torch.equal(engine.model.transformer.state_dict()[n], t) for n, t in weights.items())
    assert engine.generate([GenerationRequest(prompt="zero", seed=0, steps=2)]).weight_version == 1


def test_several_trainer_processes_need_a_cluster_address():
    with pytest.raises(ValueError, match="start it with `ray start --head` and set rollout.address=auto"):
        build_rollout_engine(RolloutConfig(backend="ray", replicas=2), "toy-digits", world=2)


def test_zero_reward_actors_score_in_this_process():
    rewards = build_rewards(RolloutConfig(), "digit_alignment:1.0")
    assert isinstance(rewards, RewardSet) and rewards.scorer_ids == ["digit_alignment"]


def test_the_example_config_is_toy_grpo_with_a_valid_rollout_section():
    """configs/toy_grpo_ray.yaml: the shipped toy run plus rollout.overlap_scoring and a `rollout` section that
    RolloutConfig accepts (2 replicas, 1 reward actor)."""
    root = Path(__file__).resolve().parents[1]
    ray_cfg = OmegaConf.to_container(OmegaConf.load(root / "configs/toy_grpo_ray.yaml"))
    base = OmegaConf.to_container(OmegaConf.load(root / "configs/toy_grpo.yaml"))
    rollout = RolloutConfig(**ray_cfg.pop("rollout"))
    assert rollout.backend == "ray" and rollout.replicas == 2 and rollout.reward_actors == 1
    assert rollout.overlap_scoring is True
    base["rollout"] = ray_cfg["rollout"] = None
    assert {**ray_cfg, "run_dir": base["run_dir"]} == base
