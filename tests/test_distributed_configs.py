"""The shipped accelerate configs (DDP, FSDP) run the GRPO recipe with 2 CPU processes on the tiny SD3 card."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flywheel.runs.checkpoint import latest_checkpoint
from flywheel.runs.rundir import read_metrics
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from tiny_models.core import build_tiny_sd3

    root = tmp_path_factory.mktemp("dist")
    (root / "prompts.txt").write_text("a red cat\na blue dog\n")
    return build_tiny_sd3(root / "sd3"), root / "prompts.txt"


def cpu_copy(name: str, tmp_path: Path) -> Path:
    """The shipped config with use_cpu: true (everything else as users get it)."""
    config = yaml.safe_load((ROOT / "configs" / "accelerate" / name).read_text())
    assert config["distributed_type"] in ("MULTI_GPU", "FSDP") and config["num_processes"] == 2
    config["use_cpu"] = True
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, run_dir: Path, folder: Path, prompts: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            str(ROOT / "trainers" / "grpo.py"), f"run_dir={run_dir}", "model.card=sd3", f"model.path={folder}",
            "tracker=none", "steps=3", f"data.prompts={prompts}", f"data.eval_prompts={prompts}",
            "data.prompts_per_step=2", "data.group_size=2", "sampling.steps=2", "eval.seeds=1",
            "sampling.height=32", "sampling.width=32", "reward.scorers=jpeg_compressibility:1.0", "eval.every=1000",
            "sample_every=1000", "train.learning_rate=1e-3", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_process_group(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def check_run(result, run_dir: Path) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]
    assert rows[1]["ratio/max_dev"] == 0.0  # on-policy first update on both ranks
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def test_ddp_two_cpu_processes_train_a_lora(tiny_sd3, tmp_path):
    folder, prompts = tiny_sd3
    result = launch(cpu_copy("ddp.yaml", tmp_path), tmp_path / "ddp", folder, prompts, "model.finetune=lora",
                    "model.lora_rank=4", "model.lora_alpha=8")
    trained = check_run(result, tmp_path / "ddp")
    assert "asks for FSDP" not in result.stderr
    assert trained and all("lora_" in k for k in trained)
    assert max(v.abs().max() for k, v in trained.items() if "lora_B" in k) > 0
    assert (tmp_path / "ddp" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_fsdp_two_cpu_processes_full_finetune_with_whole_weights(tiny_sd3, tmp_path):
    from engine import load_model

    folder, prompts = tiny_sd3
    result = launch(cpu_copy("fsdp.yaml", tmp_path), tmp_path / "fsdp", folder, prompts, "model.finetune=full")
    trained = check_run(result, tmp_path / "fsdp")
    # accelerate applies FSDP on GPUs only: on CPUs the run is plain data parallelism, and says so once.
    assert result.stderr.count("warning: the accelerate config asks for FSDP, but accelerate applies it on GPUs "
                               "only: this run is MULTI_CPU data parallelism") == 1
    base = dict(load_model("sd3", path=str(folder)).transformer.named_parameters())
    # The checkpoint holds whole (gathered) tensors, not one rank's shards, and training moved them.
    assert set(trained) == set(base)
    assert all(trained[k].shape == base[k].shape for k in base)
    assert any(not torch.equal(trained[k], base[k].detach()) for k in base)
