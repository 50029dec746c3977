"""Helpers of the recipe tests: kill -9 a recipe once a checkpoint is on disk, read a checkpoint, compare
metrics rows without their timings, and list a config's dotted keys."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def kill_after_checkpoint(recipe: str, run_dir: Path, args: list[str], step: int = 2, timeout_s: float = 300) -> None:
    """Run `python trainers/<recipe>.py run_dir=<run_dir> *args` and kill -9 it when step_<step> is saved."""
    cmd = [sys.executable, str(ROOT / "trainers" / f"{recipe}.py"), f"run_dir={run_dir}", *args]
    # The child runs on this process's thread count: the tests compare it bit for bit with runs made here, and
    # CPU matmuls round differently at other thread counts (recipes honour OMP_NUM_THREADS).
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "checkpoints" / f"step_{step:06d}").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def tiny_sd3_lora_ema_args(tmp_path: Path, run_dir: Path) -> list[str]:
    """A 2-step GRPO LoRA run with ema.enabled on a tiny SD3 (two prompts, 32x32, 2 denoising steps): the
    command-line arguments, with the tiny folder and the prompts written under `tmp_path`."""
    import tiny_models.core as tiny

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    return [f"run_dir={run_dir}", "model.card=sd3", f"model.path={tiny.build_tiny_sd3(tmp_path / 'sd3')}",
            "tracker=none", "steps=2", f"data.prompts={prompts}", f"data.eval_prompts={prompts}",
            "data.prompts_per_step=2", "data.group_size=2", "sampling.steps=2", "eval.steps=1",
            "eval.seeds=1", "sampling.height=32", "sampling.width=32", "reward.scorers=jpeg_compressibility:1.0",
            "eval.every=1000", "sample_every=1000", "train.kl_beta=0", "train.log_kl=false", "train.learning_rate=0.02",
            "model.finetune=lora", "model.lora_rank=4", "ema.enabled=true"]


def checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The tensors of a run's checkpoint at `step`."""
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def without_timings(rows: list[dict]) -> list[dict]:
    """Metrics rows without wall-clock keys (time/..., ..._s): what two runs of the same config must share."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_s")} for r in rows]


def dotted_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass (sections recursed into)."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            keys += dotted_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def negate_advantages(monkeypatch) -> None:
    """The honest control of a learning test: every later rollout's advantages with their sign flipped."""
    import flywheel.rollout_collector

    original = flywheel.rollout_collector.distributed_reward_advantages

    def negated(*args, **kwargs):
        adv, usable = original(*args, **kwargs)
        return -adv, usable

    monkeypatch.setattr(flywheel.rollout_collector, "distributed_reward_advantages", negated)
