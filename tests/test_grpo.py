"""The GRPO recipe end to end on the toy task: learning signal, resume, tracking, LoRA, ranks."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine import list_cards
from flywheel.runs.config import ConfigError, apply_overrides, parse_config
from flywheel.runs.rundir import read_metrics
from trainers.grpo import Config, main, validate_config

from launched import run_process_group
from recipe_kill import negate_advantages

ROOT = Path(__file__).resolve().parents[1]
# Small and quick, but big enough that the reward moves within a few dozen steps.
QUICK = ["tracker=none", "eval.seeds=2", "train.timestep_fraction=0.5", "save_every=1000",
         "sample_every=1000"]
STEP_KEYS = ["step", "weight_version", "reward/mean", "reward/digit_alignment/mean", "kl", "clipfrac", "loss",
             "ratio/mean", "time/rollout_s", "time/reward_s", "time/train_s"]


def run(tmp_path, name, *overrides):
    result = main([f"run_dir={tmp_path / name}", *QUICK, *overrides])
    return result, read_metrics(tmp_path / name / "metrics.jsonl")




def test_unknown_key_is_an_error_naming_the_valid_keys():
    with pytest.raises(ConfigError) as err:
        parse_config(Config, ["train.lr=1e-3"])
    message = str(err.value)
    assert "train.lr" in message and "train.learning_rate" in message and "train.clip_range" in message
    with pytest.raises(ConfigError, match="valid|Valid"):
        parse_config(Config, ["stepz=3"])


def test_metrics_rows_carry_the_documented_keys_and_versions(tmp_path):
    _, rows = run(tmp_path, "keys", "steps=2", "eval.every=2")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in STEP_KEYS:
        assert all(key in r for r in rows[1:]), key
    assert [r["weight_version"] for r in rows] == [0, 0, 1]  # the version that made the rollouts
    assert "eval/reward/mean" in rows[0] and "eval/reward/digit_alignment/mean" in rows[2]
    # The hacking watch: the judge per digit and its minimum, reward per digit, the watch's flag.
    for row in (rows[0], rows[2]):
        judged = [row[f"eval/judge/digit_svc/{d}"] for d in range(10)]
        assert row["eval/judge/digit_svc/min_class"] == min(judged)
        assert all(f"eval/reward/{d}" in row for d in range(10)) and row["eval/hacking_warning"] in (0.0, 1.0)
    # The first update is on-policy: the recomputed log-probs equal the recorded ones exactly.
    assert rows[1]["ratio/max_dev"] == 0.0 and rows[1]["clipfrac"] == 0.0
    assert rows[2]["ratio/max_dev"] == 0.0  # right after a colocated sync: trainer and rollout agree exactly
    assert (tmp_path / "keys" / "config.yaml").exists()
    assert list((tmp_path / "keys" / "samples").glob("*.png"))


def test_reward_rises_and_negated_advantages_make_it_fall(tmp_path, monkeypatch):
    """An honest control: the same run with the advantage sign flipped must go the other way. Measured (eval every
    4 steps, 2026-12-07): 0.526 -> 0.787 at step 16 (0.677 at 12), negated 0.243; 16 steps keep 0.11 over the
    bound and take two thirds of 24's time."""
    steps = ["steps=16", "eval.every=16"]
    real, _ = run(tmp_path, "real", *steps)
    negate_advantages(monkeypatch)
    control, _ = run(tmp_path, "negated", *steps)
    base = real["base"]["eval/reward/mean"]
    assert control["base"]["eval/reward/mean"] == base  # same seed, same start
    assert real["final"]["eval/reward/mean"] > base + 0.15
    assert control["final"]["eval/reward/mean"] < base - 0.05


def test_wandb_offline_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no account configured
    main([f"run_dir={tmp_path / 'wb'}", "tracker=wandb", "steps=1", "eval.every=1", "eval.seeds=1",
          "data.prompts_per_step=2", "data.group_size=4"])
    assert os.environ["WANDB_MODE"] == "offline"
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), "wandb wrote no offline run"


def test_lora_trains_only_the_adapter_and_the_disabled_adapter_is_the_reference(tmp_path):
    from engine import load_model

    _, rows = run(tmp_path, "lora", "model.finetune=lora", "train.learning_rate=1e-3", "steps=2", "eval.every=2",
                  "save_every=2", "train.kl_beta=0.01", "data.prompts_per_step=4", "data.group_size=8")
    saved = load_file(tmp_path / "lora" / "checkpoints" / "step_000002" / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in saved.items())
    # LoRA B starts at zero: the adapted model is the reference, so the first KL is exactly 0.
    assert rows[1]["kl"] == 0.0 and rows[2]["kl"] > 0.0
    base = load_model("toy-digits").transformer.state_dict()
    assert all(k.replace(".base_layer", "") in base or "lora_" in k for k in saved)


@pytest.mark.parametrize("variant", [
    [],
    # Per-trajectory windows: the ranks run different numbers of forward-backwards in a minibatch. With no_sync
    # around the backward alone every backward all-reduced, and the ranks' collectives mismatched (gloo aborted).
    ["train.variant=fast", "train.window_per=trajectory", "train.timestep_fraction=null"],
])
def test_two_processes_draw_the_same_samples_as_one(tmp_path, variant):
    args = ["steps=2", "eval.every=1000", "data.prompts_per_step=4", "data.group_size=6", *variant]  # groups span ranks
    _, single = run(tmp_path, "one", *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(ROOT / "trainers" / "grpo.py"), f"run_dir={tmp_path / 'two'}", *QUICK, *args]
    run_process_group(cmd, cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    double = read_metrics(tmp_path / "two" / "metrics.jsonl")
    # Step 1 rolls out the same weights on the same seeds: identical rewards.
    assert double[1]["reward/mean"] == pytest.approx(single[1]["reward/mean"], abs=1e-6)
    # After one DDP update (gradients averaged over ranks) the weights agree to float rounding.
    assert double[2]["reward/mean"] == pytest.approx(single[2]["reward/mean"], abs=1e-3)
    assert double[2]["weight_version"] == 1


# The other recipes' configs (*_nft, *_awm, *_dpo, *_draft) are checked by their own recipes' tests.
GRPO_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if not p.stem.endswith(("_nft", "_awm", "_dpo", "_draft"))]


def image_prompts(folder: Path, rows: int = 2, with_image: bool = True) -> Path:
    """A .jsonl prompt file whose rows name first frames (image-to-video cards), the images beside it."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 30, 30)).save(folder / "frame.png")
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"a red square {i}", **({"image": "frame.png"} if with_image
                                                                            else {})}) + "\n" for i in range(rows)))
    return path


@pytest.mark.parametrize("path", GRPO_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_parse(path, tmp_path, monkeypatch):
    """Every GRPO config, the GRPO options' included."""
    import flywheel.config.validation as sections

    cfg = parse_config(Config, ["--config", str(path)])
    assert cfg.model.card in list_cards()
    # Valid in every field (their prompt files are the user's: point them at a built-in set, or at
    # prompts with first frames for an image-to-video card; their model and scorer folders are the user's
    # too, so the checks of the machine's files and servers are left out).
    from engine import get_card

    # (toy-numbers configs keep their own built-in set: number_alignment scores no toy-digits prompt; the OCR
    # configs get quoted text to spell, which ocr needs.)
    builtin = "toy-numbers" if cfg.model.card == "toy-numbers" else "toy-digits"
    if "ocr" in str(cfg.reward.scorers):
        builtin = tmp_path / "signs.txt"
        builtin.write_text('a sign that says "HELLO"\na poster reading "FLOW"\n')
    prompts = image_prompts(tmp_path) if get_card(cfg.model.card).defaults.get("image_conditioned") else builtin
    cfg = apply_overrides(cfg, [f"data.prompts={prompts}", f"data.eval_prompts={prompts}"])
    if get_card(cfg.model.card).defaults.get("diffusers_pipeline"):
        with pytest.raises(ConfigError, match="model.path=None is not set"):  # ... which are checked
            validate_config(cfg)
    monkeypatch.setattr(sections, "check_environment", lambda cfg, checks: None)
    validate_config(cfg)


def test_toy_grpo_config_is_the_no_argument_run():
    """configs/toy_grpo.yaml writes out the defaults, which carry the mechanism chosen by the sweep of
    docs/tuning_grpo.md: a KL penalty to the base model, Flow-GRPO's 9 of 10 trained steps, 70 steps."""
    cfg = parse_config(Config, ["--config", str(ROOT / "configs" / "toy_grpo.yaml")])
    assert cfg == parse_config(Config, [])
    assert (cfg.train.kl_beta, cfg.train.learning_rate, cfg.steps, cfg.model.finetune) == (0.1, 6e-4, 70, "full")
    assert cfg.train.timestep_fraction is None and cfg.train.log_kl


def test_datasets_must_match_the_cards_image_conditioning(tmp_path):
    """Checked with the config, before any model loads: first frames for image-to-video, none elsewhere."""
    with_images = image_prompts(tmp_path / "with")
    with pytest.raises(ConfigError, match=r"prompt\(s\) 1, 2 name an \"image\" but card 'toy-digits' takes none"):
        validate_config(parse_config(Config, [f"data.prompts={with_images}"]))
    without = image_prompts(tmp_path / "without", rows=12, with_image=False)
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, ["model.card=wan2.1-i2v", f"data.prompts={without}",
                                              f"data.eval_prompts={with_images}"]))
    assert "data.prompts=" in str(err.value) and "prompt(s) 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more" in str(err.value)
    assert "data.eval_prompts" not in str(err.value)


def test_evaluation_requests_drop_the_rollouts_sde_window():
    """A window fitted to the rollouts' 10 steps must not reach the 4-step evaluation ODE (it raised there)."""
    from engine import GenerationRequest
    from flywheel.recipe.sections import eval_request_kwargs, rollout_request_kwargs

    cfg = parse_config(Config, ["sampling.sde_window=[0,8]", "eval.steps=4"])
    validate_config(cfg)
    kwargs = {**rollout_request_kwargs(cfg.sampling), **eval_request_kwargs(cfg.sampling, cfg.eval)}
    request = GenerationRequest(prompt="a handwritten three", seed=0, **kwargs)
    assert (request.steps, request.sampler, request.sde_window) == (4, "ode", None)


def test_sd3_pickscore_config_matches_flow_grpo_pickscore_sd3():
    """configs/sd3_pickscore.yaml says it follows Flow-GRPO's pickscore_sd3 (config/grpo.py, commit ac4c86e)."""
    cfg = parse_config(Config, ["--config", str(ROOT / "configs" / "sd3_pickscore.yaml")])
    flow_grpo = {  # Flow-GRPO's key -> (its value, ours)
        "sample.num_steps": (10, cfg.sampling.steps), "sample.eval_num_steps": (40, cfg.eval.steps),
        "sample.guidance_scale": (4.5, cfg.sampling.guidance_scale), "resolution": (512, cfg.sampling.height),
        "sample.num_image_per_prompt": (24, cfg.data.group_size), "prompts per epoch": (48, cfg.data.prompts_per_step),
        "sample.noise_level": (0.7, cfg.sampling.noise_level), "sample.global_std": (True, cfg.advantage.global_std),
        "train.beta": (0.01, cfg.train.kl_beta), "train.clip_range": (1e-4, cfg.train.clip_range),
        "advantage.clip_max": (5, cfg.advantage.clip_max), "train.learning_rate": (3e-4, cfg.train.learning_rate),
        "train.adam_weight_decay": (1e-4, cfg.train.weight_decay), "train.max_grad_norm": (1.0, cfg.train.max_grad_norm),
        "train.adam_beta1/2": ((0.9, 0.999), cfg.train.adam_betas), "train.cfg": (True, cfg.train.cfg_in_train),
        "train.timestep_fraction": (0.99, cfg.train.timestep_fraction), "train.batch_size": (9, cfg.train.minibatch_size),
        "optimizer steps per epoch": (2, cfg.train.updates_per_rollout), "lora r": (32, cfg.model.lora_rank),
        "lora_alpha": (64, cfg.model.lora_alpha), "init_lora_weights": ("gaussian", cfg.model.lora_init),
        "ema.enabled": (True, cfg.ema.enabled), "ema decay": (0.9, cfg.ema.decay),
        "ema update_step_interval": (8, cfg.ema.update_every),
    }
    assert {k: ours for k, (_, ours) in flow_grpo.items()} == {k: theirs for k, (theirs, _) in flow_grpo.items()}
    assert cfg.train.kl_form == "flow_grpo" and cfg.train.timestep_selection == "first"


def test_async_rollouts_lag_one_version_and_are_corrected(tmp_path):
    """The engine process rolls out step s+1 during step s's update; the trainer corrects for the lag."""
    # Two optimizer steps per rollout batch: the second minibatch's ratio leaves the proximal policy.
    _, rows = run(tmp_path, "async", "rollout.asynchronous=true", "steps=3", "eval.every=3", "data.prompts_per_step=4",
                  "data.group_size=8", "train.minibatch_size=16", "rollout.max_staleness=2")
    # Version 1 is the trainer's weights pushed into the fresh engine process (verified by checksums).
    # Two optimizer steps per update, one sync (the training loop's): a version per update.
    assert [r["train/optimizer_steps"] for r in rows[1:]] == [2, 2, 2]
    assert [r["weight_version"] for r in rows] == [1, 1, 1, 2]
    assert [r["staleness"] for r in rows[1:]] == [0, 1, 1]  # rolled out during the update before: one behind
    # Same weights in two processes: the proximal log-probs equal the behaviour ones, every weight is 1.
    assert rows[1]["is_weight/mean"] == pytest.approx(1.0, abs=1e-6)
    gap = rows[2]["logprob_gap/max"]
    assert gap > 10 * 1e-4  # the lag moved the policy past the clip range...
    assert rows[2]["clipfrac"] > 0.0  # ...and the trust region around the proximal policy clips
    # min(pi_prox / pi_behaviour, cap): not 1, and within what the largest log-prob gap allows.
    assert rows[2]["is_weight/mean"] != 1.0 and math.exp(-gap) <= rows[2]["is_weight/mean"] <= math.exp(gap)
    assert rows[3]["staleness/count_1"] == 2.0 and rows[3]["staleness/regenerated"] == 0.0
    assert "eval/reward/mean" in rows[3]
