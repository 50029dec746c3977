"""Each recipe runs a loss term's forward inside the same no_sync context as its backward: DDP (and FSDP)
decide at the forward whether the backward all-reduces. With no_sync around the backward alone, every
backward all-reduced: K times the communication of one reduction per optimizer step, and a collective mismatch
when ranks ran different numbers of them (tests/test_grpo.py runs that case on two processes)."""

import contextlib
import importlib

import pytest
from accelerate import Accelerator

from engine.toy.model import ToyDiT
from flywheel.runs.rundir import read_metrics

SMALL = ["tracker=none", "steps=1", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4",
         "eval.every=1000", "eval.seeds=1", "save_every=1000", "sample_every=1000"]


@pytest.mark.parametrize("recipe, args", [
    ("grpo", ["train.timestep_fraction=1.0"]),
    ("nft", ["train.timesteps_per_sample=2"]),
    ("awm", ["train.timesteps_per_sample=2"]),
    ("dpo", ["train.timesteps_per_pair=2"]),
    ("draft", ["train.gradient_accumulation_steps=2", "train.minibatch_size=4"]),
])
def test_training_forwards_run_inside_no_sync_except_the_last_before_an_optimizer_step(recipe, args, tmp_path,
                                                                                        monkeypatch):
    inside = []
    calls = []  # (builds a graph, inside no_sync) of every transformer forward

    @contextlib.contextmanager
    def no_sync(self, model):
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    forward = ToyDiT.forward

    def recorded(self, *a, **k):
        out = forward(self, *a, **k)  # a reference's forward (frozen weights, no grad) builds no graph
        calls.append((out.requires_grad, bool(inside)))
        return out

    monkeypatch.setattr(Accelerator, "no_sync", no_sync)
    monkeypatch.setattr(ToyDiT, "forward", recorded)
    module = importlib.import_module(f"trainers.{recipe}")
    module.main([f"run_dir={tmp_path / 'run'}", *SMALL, *args])
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["train/optimizer_steps"]
    trained = [was_inside for grad, was_inside in calls if grad]
    assert steps >= 1 and any(trained), calls  # several forward-backwards per optimizer step, the others in no_sync
    if recipe == "draft":  # a grad path's forwards are one microstep: the first minibatch's in no_sync, not the last
        assert trained[0] and not trained[-1]
    else:  # one synced forward per optimizer step: the last before it
        assert trained.count(False) == steps and not trained[-1]
