"""ema.enabled, every recipe's EMA of the trained weights: its math against hand-computed values, evaluation on the
average while rollouts stay on the trained weights, checkpoints, exact kill -9 + resume, and the config checks."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flywheel.recipe.ema import WeightEMA, train_ema_decay
from flywheel.recipe.sections import EMAConfig
from flywheel.runs.config import ConfigError, parse_config
from flywheel.runs.rundir import read_metrics

from recipe_kill import kill_after_checkpoint

# A small batch, 4 denoising steps, one eval seed: a step takes about a second on one quiet thread.
TINY = ["tracker=none", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4", "eval.seeds=1",
        "sample_every=1000"]


@pytest.fixture
def tiny(tmp_path):
    """TINY with ten evaluation prompts, one a digit (the built-in held-out set has 40): evaluations are cheap."""
    path = tmp_path / "eval_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in range(10)))
    return [*TINY, f"data.eval_prompts={path}"]


def grpo_main(argv):
    from trainers.grpo import main

    return main(argv)


def run_grpo(tmp_path, tiny, name, *overrides):
    grpo_main([f"run_dir={tmp_path / name}", *tiny, "train.timestep_fraction=0.5", *overrides])
    return read_metrics(tmp_path / name / "metrics.jsonl")


def checkpoint(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def split(saved):
    """(trained weights, EMA average) of a checkpoint's tensors."""
    trained = {k: v for k, v in saved.items() if not k.startswith(("ema/", "recipe/"))}
    return trained, {k[len("ema/"):]: v for k, v in saved.items() if k.startswith("ema/")}


def without(rows, *prefixes):
    return [{k: v for k, v in r.items() if not k.startswith(prefixes) and not k.endswith("_s")} for r in rows]


# ---- the math ------------------------------------------------------------------------------------


def schedule(decay=0.9, start=0, every=1):
    return EMAConfig(enabled=True, decay=decay, start_step=start, update_every=every)


def test_decay_schedule_is_flow_grpos_warm_up_from_the_start_step():
    oc = schedule(decay=0.9, start=0, every=1)
    # min(0.9, (1 + n)/(10 + n)): 2/11 after one step, 1/2 after 8, 0.9 from n = 80 on (81/90).
    assert train_ema_decay(1, oc) == pytest.approx(2 / 11)
    assert train_ema_decay(8, oc) == pytest.approx(0.5)
    assert train_ema_decay(79, oc) == pytest.approx(80 / 89) and 80 / 89 < 0.9
    assert train_ema_decay(80, oc) == pytest.approx(0.9) and train_ema_decay(500, oc) == 0.9
    assert train_ema_decay(8, schedule(decay=0.3)) == 0.3  # a lower ceiling cuts the ramp
    oc = schedule(decay=0.9, start=3, every=2)
    # Up to the start step the average is the weights (decay 0); then every 2nd step, n counted from the start.
    assert [train_ema_decay(s, oc) for s in range(1, 8)] == pytest.approx(
        [0.0, 0.0, 0.0, None, 3 / 12, None, 5 / 14])
    assert train_ema_decay(3 + 80, oc) == pytest.approx(0.9)


def test_two_parameters_follow_hand_computed_averages_with_start_step_and_interval():
    w, b = torch.nn.Parameter(torch.tensor([0.0])), torch.nn.Parameter(torch.tensor([[0.0, 0.0]]))
    named = [("w", w), ("b", b)]
    ema = WeightEMA(named)
    oc = schedule(decay=0.9, start=2, every=2)
    # The weights after training steps 1..6; the average starts at the step-0 weights (0, (0, 0)).
    weights = {1: (1.0, (10.0, -1.0)), 2: (2.0, (20.0, -2.0)), 3: (3.0, (30.0, -3.0)),
               4: (5.0, (50.0, -5.0)), 5: (9.0, (90.0, -9.0)), 6: (7.0, (70.0, -7.0))}
    seen = {}
    for step, (wv, bv) in weights.items():
        with torch.no_grad():
            w.fill_(wv)
            b.copy_(torch.tensor([bv]))
        decay = train_ema_decay(step, oc)
        if decay is not None:
            ema.update(named, decay)
        seen[step] = (float(ema.shadow["w"]), ema.shadow["b"].tolist()[0])
    # Steps 1, 2: n <= 0, the average is the weights. Step 3: n = 1, not a multiple of 2, no move.
    assert seen[1] == (1.0, [10.0, -1.0]) and seen[2] == (2.0, [20.0, -2.0]) and seen[3] == seen[2]
    # Step 4: n = 2, decay min(0.9, 3/12) = 0.25: 0.25·2 + 0.75·5 = 4.25 (and 42.5, -4.25).
    assert seen[4] == pytest.approx((4.25, [42.5, -4.25]))
    assert seen[5] == seen[4]
    # Step 6: n = 4, decay 5/14: (5/14)·4.25 + (9/14)·7 = 84.25/14 = 6.017857...
    assert seen[6][0] == pytest.approx(84.25 / 14, abs=1e-6)
    assert seen[6][1] == pytest.approx([842.5 / 14, -84.25 / 14], abs=1e-5)
    assert float(w.detach()) == 7.0  # the weights are only read


def test_average_is_float32_and_loading_is_strict():
    layer = torch.nn.Linear(2, 1).to(torch.bfloat16)
    named = list(layer.named_parameters())
    ema = WeightEMA(named, what="the EMA average")
    assert all(v.dtype == torch.float32 for v in ema.shadow.values())
    # 0.999·1 + 0.001·(1 + 2^-7) moves by 2^-7/1000: lost in bf16, kept in float32.
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ema.load_state_dict({"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
    with torch.no_grad():
        layer.weight.fill_(1.0 + 2**-7)
    ema.update(named, 0.999)
    assert float(ema.shadow["weight"][0, 0]) == pytest.approx(1.0 + 2**-7 / 1000, rel=1e-6)
    before = {k: v.clone() for k, v in ema.shadow.items()}
    with pytest.raises(ValueError, match="EMA average: the state's names differ"):
        ema.load_state_dict({"weight": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match=r"shape \(2, 2\) in the state, \(1, 2\) trained"):
        ema.load_state_dict({"weight": torch.zeros(2, 2), "bias": torch.zeros(1)})
    assert all(torch.equal(ema.shadow[k], v) for k, v in before.items())  # a refused state changes nothing
    with pytest.raises(ValueError, match="outside"):
        ema.update(named, 1.5)


# ---- config -------------------------------------------------------------------------------------


def test_bad_values_are_refused_with_what_is_valid():
    from trainers.grpo import Config, validate_config

    cfg = parse_config(Config, [])
    assert (cfg.ema.enabled, cfg.ema.decay, cfg.ema.start_step, cfg.ema.update_every) == (
        False, 0.9, 0, 8)
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, ["ema.decay=1.0", "ema.start_step=-1",
                                              "ema.update_every=0"]))
    message = str(err.value)
    assert "ema.decay=1.0: must be in [0, 1)" in message
    assert "ema.start_step=-1: must be an integer >= 0" in message
    assert "ema.update_every=0: must be an integer >= 1" in message
    with pytest.raises(ConfigError, match=r"ema.decay=-0.1: must be in \[0, 1\)"):
        validate_config(parse_config(Config, ["ema.decay=-0.1"]))
    validate_config(parse_config(Config, ["ema.enabled=true", "ema.decay=0.0", "ema.update_every=1",
                                          "ema.start_step=5"]))  # the edges of what is valid


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_an_ema_that_cannot_move_is_warned_about_naming_lora_ema_only_for_a_lora(finetune, capsys):
    from trainers.grpo import Config, validate_config

    validate_config(parse_config(Config, ["ema.enabled=true", "steps=3", f"model.finetune={finetune}"]))
    err = capsys.readouterr().err
    assert "ema.update_every=8 with ema.start_step=0 and steps=3: the EMA average will never move" in err
    assert ("(and lora_ema/)" in err) == (finetune == "lora")  # a full fine-tune exports no lora_ema/


# ---- in a run -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_evaluation_uses_the_average_while_rollouts_and_checkpoints_keep_the_trained_weights(tmp_path, tiny, capfd):
    """Three 2-step GRPO runs: no EMA, an EMA of decay 0 (the weights themselves), and one of decay 0.9."""
    from engine import load_model

    common = ["steps=2", "eval.every=1", "save_every=1", "keep_checkpoints=2", "train.learning_rate=3e-3"]
    off = run_grpo(tmp_path, tiny, "off", *common)
    ema_args = ["ema.enabled=true", "ema.update_every=1"]
    zero = run_grpo(tmp_path, tiny, "zero", *common, *ema_args, "ema.decay=0.0")
    avg = run_grpo(tmp_path, tiny, "avg", *common, *ema_args, "ema.decay=0.9")

    # Decay 0: the average is the trained weights, so the run is the run without EMA, metric for metric.
    assert without(zero, "eval/ema", "ema/") == without(off)
    assert all(r["eval/ema"] == 1.0 for r in zero) and all("eval/ema" not in r for r in off)
    assert [r["ema/decay"] for r in zero[1:]] == [0.0, 0.0]
    # Decay 0.9: rollouts, losses and versions are those of the run without EMA (the evaluation at step 1,
    # on the average, put the trained weights back before step 2 rolled out) ...
    evaluation = ("eval/", "ema/")
    assert without(avg, *evaluation) == without(off, *evaluation)
    assert [r["weight_version"] for r in avg] == [0, 0, 1]  # the version each step's rollouts came from
    # ... the base evaluation is the same (the average starts at the weights), the later ones are not.
    assert avg[0]["eval/reward/mean"] == off[0]["eval/reward/mean"]
    assert avg[2]["eval/reward/mean"] != off[2]["eval/reward/mean"]
    assert [r["ema/decay"] for r in avg[1:]] == pytest.approx([2 / 11, 3 / 12])

    # The checkpoints hold the trained weights (the same as without EMA) and, under ema/, the average:
    # E1 = d1·E0 + (1 - d1)·W1 from the card's weights E0, then E2 = d2·E1 + (1 - d2)·W2.
    base = dict(load_model("toy-digits").transformer.named_parameters())
    (w1, e1), (w2, e2) = split(checkpoint(tmp_path / "avg", 1)), split(checkpoint(tmp_path / "avg", 2))
    off_w2, off_e2 = split(checkpoint(tmp_path / "off", 2))
    assert e1.keys() == w1.keys() == base.keys() and not off_e2
    assert all(torch.equal(w2[k], off_w2[k]) for k in w2)
    for name, w in w1.items():
        expected = base[name].detach().float().clone().mul_(2 / 11).add_(w, alpha=1 - 2 / 11)
        assert torch.equal(e1[name], expected), name
        expected = expected.mul_(3 / 12).add_(w2[name], alpha=1 - 3 / 12)
        assert torch.equal(e2[name], expected), name
    assert any(not torch.equal(e2[k], w2[k]) for k in w2)

    # Resuming with ema.enabled off from a run that had one drops the average, and says so.
    grpo_main([f"resume={tmp_path / 'avg'}", "steps=3", "ema.enabled=false"])
    assert "holds an EMA average and this run has ema.enabled=false" in capfd.readouterr().err
    assert not split(checkpoint(tmp_path / "avg", 3))[1]
    # Resuming with ema.enabled on from a run that had none is refused: the average would start over silently.
    with pytest.raises(ValueError, match="holds no EMA average"):
        grpo_main([f"resume={tmp_path / 'off'}", "steps=3", "ema.enabled=true"])


@pytest.mark.slow
def test_async_rollouts_evaluate_the_average_in_the_trainer_process(tmp_path, tiny):
    """With async rollouts the engine process holds only synced weights: the evaluation runs the trained module
    here, with the average swapped in. Decay 0 evaluates the weights themselves, as the run without EMA does
    (in the engine process: the same numbers, up to the threads' summation order); decay 0.9 evaluates
    something else, while the rollouts (rewards) stay those of the run without EMA."""
    common = ["steps=2", "eval.every=1", "train.learning_rate=3e-3", "rollout.asynchronous=true"]
    ema_args = ["ema.enabled=true", "ema.update_every=1"]
    off = run_grpo(tmp_path, tiny, "off", *common)
    zero = run_grpo(tmp_path, tiny, "zero", *common, *ema_args, "ema.decay=0.0")
    avg = run_grpo(tmp_path, tiny, "avg", *common, *ema_args, "ema.decay=0.9")
    evals = {name: [r["eval/reward/mean"] for r in rows] for name, rows in (("off", off), ("zero", zero), ("avg", avg))}
    assert evals["zero"] == pytest.approx(evals["off"], abs=1e-5)
    assert evals["avg"][0] == pytest.approx(evals["off"][0], abs=1e-5)  # the average starts at the weights
    assert all(abs(a - o) > 1e-3 for a, o in zip(evals["avg"][1:], evals["off"][1:]))
    assert [r["reward/mean"] for r in avg[1:]] == [r["reward/mean"] for r in off[1:]]
    assert all(r["eval/ema"] == 1.0 for r in avg)


@pytest.mark.slow
def test_kill_and_resume_gives_the_metrics_and_ema_tensors_of_an_uninterrupted_run(tmp_path, tiny):
    # The average is the weights up to step 1, then moves with decay 2/11, 3/12, 4/13 after steps 2, 3, 4: a
    # resume that restarted it from the resumed weights would change the last evaluation and every ema/ tensor.
    # (Two steps after the checkpoint the kill waits for: the run cannot finish before it is killed.)
    args = ["steps=4", "save_every=2", "eval.every=4", "train.learning_rate=3e-3", "ema.enabled=true",
            "ema.start_step=1", "ema.update_every=1"]
    straight = run_grpo(tmp_path, tiny, "straight", *args)

    interrupted = tmp_path / "interrupted"
    kill_after_checkpoint("grpo", interrupted, [*tiny, "train.timestep_fraction=0.5", *args])
    assert not (interrupted / "checkpoints" / "step_000004").exists()
    grpo_main([f"resume={interrupted}"])

    rows = read_metrics(interrupted / "metrics.jsonl")
    assert without(rows, "time/") == without(straight, "time/")
    assert [r["ema/decay"] for r in rows[1:]] == pytest.approx([0.0, 2 / 11, 3 / 12, 4 / 13])
    assert rows[-1]["eval/ema"] == 1.0
    expected, got = checkpoint(tmp_path / "straight", 4), checkpoint(interrupted, 4)
    assert expected.keys() == got.keys() and any(k.startswith("ema/") for k in got)
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
    trained, average = split(got)
    assert any(not torch.equal(average[k], trained[k]) for k in trained)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["awm", "nft"])
def test_awm_and_nft_accept_ema_beside_their_own_tensors(tmp_path, tiny, recipe):
    """A 2-step run with ema.enabled=true (AWM with LoRA: the average is the adapter's), then one step resumed."""
    import importlib

    main = importlib.import_module(f"trainers.{recipe}").main
    extra = {"awm": ["train.timesteps_per_sample=2", "model.finetune=lora", "train.learning_rate=1e-3"],
             "nft": ["train.timesteps_per_sample=2"]}[recipe]
    run_dir = tmp_path / recipe
    main([f"run_dir={run_dir}", *tiny, *extra, "steps=2", "eval.every=1000", "save_every=2", "ema.enabled=true",
          "ema.update_every=1", "ema.decay=0.5"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[0]["eval/ema"] == 1.0 and rows[2]["eval/ema"] == 1.0
    assert [r["ema/decay"] for r in rows[1:]] == pytest.approx([2 / 11, 3 / 12])
    saved = checkpoint(run_dir, 2)
    trained, average = split(saved)
    assert average.keys() == trained.keys()
    assert any(k.startswith("recipe/") for k in saved)  # the anchor / the sampling policy, kept apart
    if recipe == "awm":
        assert all("lora_" in k for k in average)
    # Resume one more step: the recipe gets its own tensors back, the run its average.
    main([f"resume={run_dir}", "steps=3", "save_every=3"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1]["step"] == 3 and rows[-1]["ema/decay"] == pytest.approx(4 / 13) and rows[-1]["eval/ema"] == 1.0
    trained3, average3 = split(checkpoint(run_dir, 3))
    for name, e2 in average.items():
        assert torch.equal(average3[name], e2.clone().mul_(4 / 13).add_(trained3[name].float(), alpha=1 - 4 / 13))


@pytest.mark.slow
def test_the_trained_lora_and_the_average_are_exported_side_by_side(tmp_path, capfd):
    """run_dir/lora (a stock pipeline's load_lora_weights) is the trained adapter, run_dir/lora_ema the average
    (what Flow-GRPO saves), and the final lines say which is which."""
    from recipe_kill import tiny_sd3_lora_ema_args

    run_dir = tmp_path / "run"
    grpo_main([*tiny_sd3_lora_ema_args(tmp_path, run_dir), "ema.update_every=1", "ema.decay=0.5"])
    trained, average = split(checkpoint(run_dir, 2))
    # peft's "<module>.lora_A.default.weight" is diffusers' "transformer.<module>.lora_A.weight".
    as_exported = {"transformer." + k.replace(".default", ""): k for k in average}
    for folder, expected in (("lora", trained), ("lora_ema", average)):
        exported = load_file(str(run_dir / folder / "pytorch_lora_weights.safetensors"))
        assert as_exported.keys() == exported.keys()
        for name, ours in as_exported.items():
            assert torch.equal(exported[name], expected[ours].to(exported[name].dtype)), (folder, name)
    assert any(not torch.equal(average[k], trained[k]) for k in trained if "lora_B" in k)
    out = capfd.readouterr().out
    assert f"{run_dir / 'lora'}: the trained adapter\n" in out
    assert f"{run_dir / 'lora_ema'}: the EMA average of the trained adapter (the one evaluation used)" in out
    assert "(of the EMA average)" in out
