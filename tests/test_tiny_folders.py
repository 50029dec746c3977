"""`python tests/tiny_models`: a tiny stand-in folder of any card, for a smoke test.

Each card's folder is written through the documented entry point, then read the
two ways a user's folder is: the card's loader (a one-step generation through
the engine, checked for the card's output shape) and the stock diffusers
pipeline's `from_pretrained`. The smoke command the tool prints is run as a
one-step GRPO LoRA run on the SD3 folder.
"""

import json
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import Engine, GenerationRequest, get_card, list_cards
from engine.card_folders import check_card_path
from flywheel.runs.rundir import read_metrics
from tiny_models.folders import (SHIPPED_CARDS, TINY_BUILDERS, TINY_SIZES, TinyFolderError, main, smoke_command,
                                 write_tiny_folder)

ROOT = Path(__file__).resolve().parents[1]
# What every folder holds besides its family's own components (what check_diffusers_folder asks of a user's).
COMMON = {"model_index.json", "transformer", "vae", "scheduler", "text_encoder", "tokenizer"}


def test_every_card_of_the_project_has_a_tiny_folder_or_ships_its_weights():
    assert sorted(TINY_BUILDERS) == sorted(set(list_cards()) - set(SHIPPED_CARDS))
    assert set(TINY_SIZES) == set(TINY_BUILDERS)


@pytest.fixture(scope="module")
def first_frame(tmp_path_factory):
    path = tmp_path_factory.mktemp("frame") / "frame.png"
    Image.fromarray((np.random.default_rng(0).random((20, 36, 3)) * 255).astype(np.uint8)).save(path)
    return str(path)


@pytest.mark.parametrize("card", list(TINY_BUILDERS))
def test_the_folder_loads_in_the_engine_and_the_stock_pipeline(card, tmp_path, capsys, first_frame):
    from diffusers import DiffusionPipeline

    out = tmp_path / "tiny"
    out.mkdir()  # an empty folder is fine
    assert main(["--card", card, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote a tiny random {card} folder to {out}" in printed and f"model.path={out}" in printed
    assert COMMON <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".*partial"))  # the staging folder is gone
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == get_card(card).defaults["diffusers_pipeline"]
    check_card_path(card, str(out))  # the checks before work pass: each component's files are the ones it needs

    size = TINY_SIZES[card]
    engine = Engine.from_card(card, path=str(out))
    steps = 2 if card.startswith("qwen-image") else 1  # Qwen-Image's terminal sigma refuses one-step schedules
    extra = (dict(image=first_frame) if get_card(card).defaults.get("image_conditioned")
             else dict(audio=True) if card == "ltx2" else {})
    traj = engine.generate([GenerationRequest(prompt=p, seed=s, card=card, steps=steps, sampler="sde", **size,
                                              **extra) for p, s in (("a red cat", 1), ("a blue dog", 2))])
    # The tiny LTX-2 video VAE halves time on the way in and does not double it on the way out: 5 frames
    # requested are 3 latent frames, decoded as 3 (the released VAE's 8k+1 frames come back whole).
    frames = ((3 if card == "ltx2" else size["frames"]),) if "frames" in size else ()
    assert tuple(traj.images.shape) == (2, 3, *frames, size["height"], size["width"])
    assert torch.isfinite(traj.images).all() and torch.isfinite(traj.log_probs).all()
    assert tuple(traj.log_probs.shape) == (2, steps)
    if card == "ltx2":
        assert traj.audio.shape[0] == 2 and torch.isfinite(traj.audio).all()

    # Without torchvision transformers cannot build Qwen2VLProcessor: the card's image-only one stands in.
    from engine.families.qwen_image_edit import load_vl_processor

    kwargs = dict(processor=load_vl_processor(out / "processor")) if card == "qwen-image-edit-plus" else {}
    pipe = DiffusionPipeline.from_pretrained(str(out), **kwargs)
    assert type(pipe).__name__ == index["_class_name"]
    # The same transformer weights the engine runs (a two-expert card: each expert's, `high` and `low`).
    served = engine.model.transformer
    pairs = ([(pipe.transformer, served.high), (pipe.transformer_2, served.low)] if hasattr(served, "high")
             else [(pipe.transformer, served)])
    for stock, module in pairs:
        ours = dict(module.named_parameters())
        for name, value in stock.named_parameters():
            assert torch.equal(value, ours[name]), name


def test_an_unknown_card_lists_the_valid_ones_before_writing_anything(tmp_path, capsys):
    out = tmp_path / "nope"
    assert main(["--card", "sd5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --card sd5:") and ", ".join(TINY_BUILDERS) in err
    assert not out.exists() and not list(tmp_path.iterdir())
    assert main(["--card", "toy-digits", "--out", str(out)]) == 2
    assert "ships its weights" in capsys.readouterr().err


def test_the_documented_command_runs_from_the_repository_root(tmp_path):
    """`python tests/tiny_models ...` (README, docs/models.md), in a fresh interpreter without tests/ on its
    path: the folder's entry point finds its own package."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the editable install's place, not tests/
    cmd = [sys.executable, "tests/tiny_models"]
    out = subprocess.run([*cmd, "--card", "sd5", "--out", str(tmp_path / "x")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --card sd5:"), out.stderr[-2000:]
    assert ", ".join(TINY_BUILDERS) in out.stderr and not list(tmp_path.iterdir())
    usage = subprocess.run([*cmd, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python tests/tiny_models ")


def test_no_product_package_ships_or_imports_the_tiny_builders():
    """The wheel packages what pyproject's packages.find includes: the tiny builders are test support."""
    import re

    from setuptools import find_namespace_packages

    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.findall(r'"([^"]+)"', re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*?)\]",
                                                 pyproject).group(1))
    shipped = find_namespace_packages(where=str(ROOT), include=include)
    assert {"engine", "engine.families", "rewards", "flywheel", "trainers"} <= set(shipped)
    assert not [p for p in shipped if p.split(".")[0] in ("tests", "tiny_models")]
    sources = [p for package in shipped for p in (ROOT / package.replace(".", "/")).glob("*.py")]
    assert not [p for p in sources if p.name.startswith("tiny")]
    assert not [p for p in sources if "tiny_models" in p.read_text()]


def test_without_diffusers_the_error_says_what_to_install(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # makes `import diffusers` raise ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["--card", "flux", "--out", str(tmp_path / "flux")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the tiny flux folder") and 'pip install -e ".[diffusers]"' in err
    assert not list(tmp_path.iterdir())  # the staging folder is removed too


@pytest.mark.parametrize("make, message", [
    (lambda p: (p.mkdir(), (p / "keep.txt").write_text("mine")), "not empty"),
    (lambda p: p.write_text("a file"), "is a file"),
])
def test_an_output_path_in_use_is_refused_and_left_as_it_was(tmp_path, capsys, make, message):
    out = tmp_path / "out"
    make(out)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["--card", "sd3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}:") and message in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(TinyFolderError, match=message):
        write_tiny_folder("sd3", out)


def test_the_printed_smoke_command_trains_one_step_on_the_tiny_sd3_folder(tmp_path):
    """The documented smoke run: one GRPO LoRA step on the tiny SD3 folder, as the tool prints it."""
    from trainers.grpo import main as grpo_main

    folder = write_tiny_folder("sd3", tmp_path / "tiny-sd3")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    argv = shlex.split(smoke_command("sd3", folder))
    assert argv[:2] == ["python", "trainers/grpo.py"]
    run_dir = tmp_path / "smoke"
    overrides = [a.replace("PROMPTS.txt", str(prompts)) for a in argv[2:] if not a.startswith("run_dir=")]
    grpo_main([*overrides, f"run_dir={run_dir}"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["weight_version"] == 0 and rows[-1]["train/skipped_steps"] == 0  # the step trained
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()


def shipped_ltx2_config(tmp_path):
    """The argv of configs/ltx2_av_sync.yaml with its prompt files (yours to provide) given."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a drummer hitting a snare drum\na door slamming shut\n")
    return ["--config", str(ROOT / "configs" / "ltx2_av_sync.yaml"), f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}"]


def test_the_shipped_ltx2_config_validates(tmp_path, monkeypatch):
    """configs/ltx2_av_sync.yaml: every key valid as shipped (sizes within the card's rules, audio on a card
    that makes it, the rewards known); its model folder is the user's, so the environment checks are off."""
    from flywheel.config import validation as sections
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config, validate_config

    monkeypatch.setattr(sections, "check_environment", lambda cfg, checks: None)

    cfg = parse_config(Config, shipped_ltx2_config(tmp_path))
    validate_config(cfg)  # raises ConfigError naming every bad key
    assert (cfg.model.card, cfg.sampling.audio, cfg.sampling.frames) == ("ltx2", True, 121)
    assert cfg.reward.scorers == "av_onset_sync:1.0,audio_loudness:0.5" and cfg.reward.aggregation == "sum_of_advantages"


@pytest.mark.slow  # a GRPO step with audio, a reference forward and two evaluations with MP4s: ~20 s of CPU
def test_the_shipped_ltx2_config_trains_a_step_on_the_tiny_folder(tmp_path):
    """One GRPO step of configs/ltx2_av_sync.yaml on the tiny LTX-2 folder at its tiny size: both rewards
    scored, the KL measured, MP4s and WAVs written."""
    from trainers.grpo import main as grpo_main

    shipped = shipped_ltx2_config(tmp_path)
    folder = write_tiny_folder("ltx2", tmp_path / "tiny-ltx2")
    size = [f"sampling.{k}={v}" for k, v in TINY_SIZES["ltx2"].items()]
    run_dir = tmp_path / "run"
    grpo_main([*shipped, f"model.path={folder}", f"run_dir={run_dir}", *size, "model.dtype=float32", "steps=1",
               "tracker=none", "data.prompts_per_step=2", "data.group_size=2", "sampling.steps=2",
               "eval.steps=1", "model.lora_rank=4", "model.lora_alpha=8", "train.gradient_checkpointing=false"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward/av_onset_sync/mean", "reward/audio_loudness/mean", "kl"):
        assert key in rows[1], key
    assert sorted(p.suffix for p in (run_dir / "samples").glob("step-000001-*")) == [".mp4", ".mp4", ".wav", ".wav"]
