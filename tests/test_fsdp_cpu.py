"""The recipes' FSDP path, run on two CPU processes (tests/cpu_fsdp.py makes accelerate apply FSDP there): the
run trains as DDP does, a checkpoint holds whole tensors and the whole optimizer state (not the main process's
shards), and a resume from it is exact. Before, a resume failed on the shards' sizes, and a LoRA run's KL
reference ran the module outside FSDP's gather and failed at the first update."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flywheel.runs.checkpoint import latest_checkpoint
from flywheel.runs.config import parse_config
from flywheel.runs.rundir import read_metrics
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["tracker=none", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=10", "eval.every=3",
         "eval.seeds=1", "save_every=2", "sample_every=1000"]
pytestmark = pytest.mark.slow


def cpu_config(name: str, tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "accelerate" / f"{name}.yaml").read_text())
    config["use_cpu"] = True
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(tmp_path: Path, kind: str, recipe: str, *args: str) -> None:
    shim = [str(ROOT / "tests" / "cpu_fsdp.py")] if kind == "fsdp" else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cpu_config(kind, tmp_path)),
           "--main_process_port", "0", *shim, str(ROOT / "trainers" / f"{recipe}.py"), *SMALL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = run_process_group(cmd, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    if kind == "fsdp":  # the run did shard: no fall-back warning
        assert "accelerate applies it on GPUs only" not in out.stderr


def tensors(run: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / name))


def close(a: dict, b: dict, atol: float) -> bool:
    return set(a) == set(b) and all(a[k].shape == b[k].shape and torch.allclose(a[k].float(), b[k].float(), atol=atol,
                                                                                  rtol=0) for k in a)


def test_a_full_fine_tune_under_fsdp_trains_as_ddp_and_resumes_exactly(tmp_path):
    ddp, fsdp, resumed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    launch(tmp_path, "ddp", "grpo", f"run_dir={ddp}", "steps=3", "model.finetune=full")
    launch(tmp_path, "fsdp", "grpo", f"run_dir={fsdp}", "steps=3", "model.finetune=full")
    rows_ddp, rows_fsdp = read_metrics(ddp / "metrics.jsonl"), read_metrics(fsdp / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows_fsdp[1:]] == pytest.approx([r["reward/mean"] for r in rows_ddp[1:]],
                                                                      abs=1e-6)
    # Whole tensors, and the whole optimizer state by parameter name: the main process's shards were saved before.
    assert close(tensors(fsdp, 3, "model.safetensors"), tensors(ddp, 3, "model.safetensors"), atol=1e-4)
    opt_fsdp, opt_ddp = tensors(fsdp, 3, "optimizer.safetensors"), tensors(ddp, 3, "optimizer.safetensors")
    assert close(opt_fsdp, opt_ddp, atol=1e-6)
    # exp_avg is not exp_avg_sq (torch's CPU offload of the gathered state returned one tensor for both).
    key = "blocks.0.qkv.weight"
    assert not torch.equal(opt_fsdp[f"{key}.exp_avg"], opt_fsdp[f"{key}.exp_avg_sq"])
    # Resume from step 2 under FSDP: step 3 is the uninterrupted run's, bit for bit.
    shutil.copytree(fsdp, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    (resumed / ".flywheel.lock").unlink(missing_ok=True)
    launch(tmp_path, "fsdp", "grpo", f"resume={resumed}")
    assert latest_checkpoint(resumed).name == "step_000003"
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert close(tensors(resumed, 3, name), tensors(fsdp, 3, name), atol=0.0), name


def test_a_lora_run_under_fsdp_takes_its_kl_reference_through_the_wrapper(tmp_path):
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    for kind, run in (("ddp", ddp), ("fsdp", fsdp)):
        launch(tmp_path, kind, "grpo", f"run_dir={run}", "steps=3", "model.finetune=lora", "train.kl_beta=0.1")
    rows = read_metrics(fsdp / "metrics.jsonl")
    assert rows[2]["kl"] > 0  # the adapter moved at step 1: the reference (adapter off) differs from it
    assert [r["kl"] for r in rows[1:]] == pytest.approx([r["kl"] for r in read_metrics(ddp / "metrics.jsonl")[1:]],
                                                        rel=1e-4, abs=1e-9)
    assert close(tensors(fsdp, 3, "model.safetensors"), tensors(ddp, 3, "model.safetensors"), atol=1e-5)


@pytest.mark.parametrize("recipe, args, message", [
    ("awm", [], "train.anchor_beta=1.0 with an FSDP launch: the EMA anchor swaps whole weights"),
    ("nft", [], "FSDP launch: DiffusionNFT's sampling policy is a whole copy"),
    ("draft", [], "FSDP launch: not supported by DRaFT"),
    # Each rank runs a forward per step its rows' windows cover: different counts, and FSDP's forwards gather.
    ("grpo", ["train.variant=fast"], "train.variant=fast with train.window_per=trajectory and an FSDP launch"),
])
def test_what_fsdp_cannot_shard_or_run_alike_on_every_rank_is_refused_before_work(recipe, args, message, monkeypatch):
    import importlib

    from flywheel.config.parsing import ConfigError

    module = importlib.import_module(f"trainers.{recipe}")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=message):
        module.validate_config(parse_config(module.Config, args))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    module.validate_config(parse_config(module.Config, args))
