"""The recipe refuses bad configs up front and stops on bad numbers: issue 11's items 3, 5, 9, 10 and 16."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from flywheel.runs.config import ConfigError, parse_config
from flywheel.guards import NonFiniteError
from flywheel.rollout_collector import sample_seed
from flywheel.prompts import PromptItem, load_prompts
from flywheel.runs.rundir import read_metrics
from rewards import registry
from trainers.grpo import Config, main, validate_config
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
TINY = ["tracker=none", "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4",
        "sample_every=1000", "eval.every=1000"]


def config_problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, list(overrides)))
    return str(err.value)


# ---- item 16: every field checked before anything runs --------------------------------------


@pytest.mark.parametrize("override, names", [
    ("save_every=0", "save_every=0"),
    ("eval.every=0", "eval.every=0"),
    ("train.gradient_accumulation_steps=0", "train.gradient_accumulation_steps=0"),
    ("data.group_size=1", "data.group_size=1"),
    ("data.group_size=0", "data.group_size=0"),
    ("train.minibatch_size=0", "train.minibatch_size=0"),
    ("train.clip_range=-0.1", "train.clip_range=-0.1"),
    ("steps=0", "steps=0"),
    ("steps=-3", "steps=-3"),
    ("keep_checkpoints=0", "keep_checkpoints=0"),
    ("sampling.noise_level=nan", "sampling.noise_level=nan: must be a finite number"),
    ("sampling.guidance_scale=inf", "sampling.guidance_scale=inf: must be a finite number"),
    ("train.learning_rate=nan", "train.learning_rate=nan: must be a finite number"),
    ("sampling.sde_window=[4,2]", "sampling.sde_window"),
    ("train.timestep_fraction=0", "train.timestep_fraction=0.0"),
    ("eval.cache_threshold=-0.1", "eval.cache_threshold=-0.1"),
])
def test_each_bad_field_is_named_with_its_valid_range(override, names):
    message = config_problems(override)
    assert names in message
    assert "must" in message  # says what is valid, not only what is wrong


def test_audio_keys_are_checked_against_the_card_and_each_other():
    message = config_problems("sampling.audio=true")  # the default card is toy-digits: no sound
    assert "sampling.audio=true" in message and "'toy-digits' generates no sound" in message and "ltx2" in message
    assert "sampling.audio=false" in config_problems("sampling.audio_guidance_scale=4.0")
    assert "sampling.audio=false" in config_problems("sampling.audio_noise_level=0.0")
    message = config_problems("model.card=ltx2", "sampling.audio=true", "sampling.audio_noise_level=-1")
    assert "sampling.audio_noise_level=-1" in message and "must be in [0, 10]" in message


def test_evaluation_with_the_adaptive_loop_reports_its_model_calls(tmp_path):
    main([f"run_dir={tmp_path / 'plain'}", *TINY, "steps=1"])
    main([f"run_dir={tmp_path / 'cached'}", *TINY, "steps=1", "eval.cache_threshold=0.3"])
    rows = read_metrics(tmp_path / "cached" / "metrics.jsonl")
    assert all(0 < r["eval/model_calls"] < 4 for r in rows if "eval/reward/mean" in r)  # of 4 eval steps
    assert "eval/model_calls" not in read_metrics(tmp_path / "plain" / "metrics.jsonl")[0]
    plain_rows = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert rows[1]["reward/mean"] == plain_rows[1]["reward/mean"]  # the training rollouts never skip
    assert rows[0]["eval/reward/mean"] != plain_rows[0]["eval/reward/mean"]  # the evaluation skipped some calls


def test_all_problems_are_reported_at_once():
    message = config_problems("steps=0", "save_every=0", "train.kl_form=flow_grpo", "sampling.sampler=cps",
                              "sampling.noise_level=0.5")
    assert "steps=0" in message and "save_every=0" in message and "train.kl_form=flow_grpo" in message


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a handwritten 3"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected a JSON object .* got list"):
        load_prompts(str(bad))
    assert f"data.prompts='{bad}'" in config_problems(f"data.prompts={bad}")


def test_a_prompt_file_is_txt_or_jsonl_in_utf8(tmp_path):
    array = tmp_path / "p.json"  # read line by line, its brackets and quotes would each be a "prompt"
    array.write_text('["a handwritten 3",\n "a handwritten 7"]\n')
    with pytest.raises(ValueError, match=r"p.json has the suffix '.json'; a prompt file is .txt .* or .jsonl"):
        load_prompts(str(array))
    assert f"data.eval_prompts='{array}'" in config_problems(f"data.eval_prompts={array}")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("a handwritten 3\nun caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:2: not UTF-8 text \(byte 0xe9\)"):
        load_prompts(str(latin1))
    windows = tmp_path / "windows.jsonl"  # a BOM and CRLF line ends, as Windows editors write
    windows.write_bytes(b'\xef\xbb\xbf{"prompt": "a handwritten 3"}\r\n{"prompt": "a 7", "digit": 7}\r\n')
    assert load_prompts(str(windows)) == [PromptItem("a handwritten 3"), PromptItem("a 7")]
    assert load_prompts(str(windows))[1].metadata == {"digit": 7}
    text = tmp_path / "windows.TXT"
    text.write_bytes(b"\xef\xbb\xbfa handwritten 3\r\na 7\r\n")
    assert [item.prompt for item in load_prompts(str(text))] == ["a handwritten 3", "a 7"]


def test_config_errors_stop_before_the_run_dir_is_touched(tmp_path):
    with pytest.raises(ConfigError):
        main([f"run_dir={tmp_path / 'r'}", "tracker=none", "save_every=0"])
    assert not (tmp_path / "r").exists()


def test_under_accelerate_launch_the_config_error_is_the_last_thing_printed(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = run_process_group([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
                          "trainers/grpo.py",
                          "save_every=0", "tracker=none", f"run_dir={tmp_path / 'r'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert "CalledProcessError" in out.stderr  # accelerate's own traceback is there...
    assert lines[-2:] == ["error: invalid config:", "  save_every=0: must be an integer >= 1"]  # ...and we come after


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="zombies are told apart through /proc (Linux)")
def test_the_repeated_message_stops_waiting_for_a_launcher_that_exited_but_is_not_reaped():
    """The message is repeated once the launcher is gone. An exited launcher stays a zombie until its parent
    reaps it, and a parent reading the pipe to its end (subprocess.run, a shell pipe) reaps only after the
    waiting process lets go of stderr: counted as alive, it held every such launch for a minute."""
    from flywheel.cli import _process_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; not reaped yet
    os.kill(child.pid, 0)  # signal 0 still reaches it: it cannot tell
    assert not _process_alive(child.pid)
    assert _process_alive(os.getpid())
    child.wait()
    assert not _process_alive(child.pid)


# ---- item 3: silent off-policy training refused ---------------------------------------------


def test_unguided_training_of_guided_rollouts_is_refused():
    message = config_problems("train.cfg_in_train=false", "sampling.guidance_scale=4.5")
    assert "train.cfg_in_train=false" in message and "policy other than the one that sampled" in message
    # Unguided rollouts: there is no guidance to leave out of the training forward, so the key would do nothing.
    message = config_problems("train.cfg_in_train=false", "sampling.guidance_scale=1.0")
    assert ("train.cfg_in_train=false with sampling.guidance_scale=1.0: the rollouts use no guidance, so the "
            "training forward has none to leave out and the key would be ignored") in message
    validate_config(parse_config(Config, ["train.cfg_in_train=true", "sampling.guidance_scale=1.0"]))


def test_time_shift_on_a_card_with_its_own_schedule_is_an_error(tmp_path, monkeypatch):
    import flywheel.recipe.policy as policy

    toy = load_model("toy-digits")
    toy.schedule = lambda steps, shape: torch.linspace(1, 0, steps + 1)  # as SD3, FLUX and Wan have
    monkeypatch.setattr(policy, "load_model", lambda *a, **k: toy)
    with pytest.raises(ConfigError, match="sampling.time_shift=3.0: the toy-digits card takes its schedule"):
        main([f"run_dir={tmp_path / 'r'}", *TINY, "steps=1", "sampling.time_shift=3.0"])


# ---- item 5: rollout seeds of different runs never collide ----------------------------------


def test_rollout_seeds_of_two_runs_share_none():
    assert sample_seed(1, 0, 27) != sample_seed(0, 10, 0)  # equal under the old linear mix
    default_run = [(step, row) for step in range(80) for row in range(128)]
    seeds = {run: {sample_seed(run, s, r) for s, r in default_run} for run in (0, 1, 2)}
    assert all(len(s) == len(default_run) for s in seeds.values())  # no repeat inside a run
    assert not seeds[0] & seeds[1] and not seeds[0] & seeds[2] and not seeds[1] & seeds[2]
    assert all(0 <= s < 2**63 for s in seeds[0])
    assert sample_seed(0, 3, 5) == sample_seed(0, 3, 5)  # a pure function


# ---- items 9 and 10: non-finite numbers and fully masked steps ------------------------------


@pytest.fixture
def nan_reward():
    registry.register("always_nan", lambda **_: (lambda images, prompts, metadata: torch.full((len(prompts),),
                                                                                                float("nan"))))
    yield "always_nan"
    registry.unregister("always_nan")


def test_fully_masked_steps_do_not_move_the_weights_and_a_nan_final_eval_fails(tmp_path, nan_reward):
    run_dir = tmp_path / "masked"
    with pytest.raises(NonFiniteError, match="final evaluation reward"):
        main([f"run_dir={run_dir}", *TINY, "steps=2", "save_every=2", f"reward.scorers={nan_reward}:1.0"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["train/skipped_steps"] for r in rows[1:]] == [1, 2]
    saved = load_file(str(run_dir / "checkpoints" / "step_000002" / "model.safetensors"))
    base = load_model("toy-digits").transformer.state_dict()
    assert all(torch.equal(saved[name], base[name]) for name in base)  # not even AdamW's weight decay moved them
    assert rows[-1]["weight_version"] == 0


def test_consecutive_fully_masked_steps_stop_the_run(tmp_path, nan_reward):
    with pytest.raises(RuntimeError, match=r"step 3: the rewards masked every sample of the last 3 steps"):
        main([f"run_dir={tmp_path / 'm'}", *TINY, "steps=10", f"reward.scorers={nan_reward}:1.0",
              "reward.max_masked_steps=3"])


def test_a_weight_gone_nan_stops_the_run_at_its_step_and_keeps_the_good_checkpoints(tmp_path, monkeypatch):
    run_dir = tmp_path / "blowup"
    main([f"run_dir={run_dir}", *TINY, "steps=1", "save_every=1"])  # one good step, checkpointed
    good = load_file(str(run_dir / "checkpoints" / "step_000001" / "model.safetensors"))
    original_step = torch.optim.AdamW.step

    def step_then_poison(self, *args, **kwargs):  # an update that leaves an inf behind (a bad lr, a bad batch)
        out = original_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][3].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_poison)
    with pytest.raises(NonFiniteError, match=r"step 2: weight '[\w.]+' \(1 tensor\(s\) in all\) holds NaN or inf"):
        main([f"resume={run_dir}", "steps=3", "save_every=1"])
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000001"]  # nothing bad saved, nothing good pruned
    kept = load_file(str(run_dir / "checkpoints" / "step_000001" / "model.safetensors"))
    assert all(torch.equal(kept[k], good[k]) for k in good)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]  # no row of the bad step


def test_a_nan_gradient_stops_before_the_optimizer_step(monkeypatch, tmp_path):
    import trainers.grpo as grpo

    original = grpo.grpo_step_loss

    def nan_loss(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(grpo, "grpo_step_loss", nan_loss)
    with pytest.raises(NonFiniteError, match="step 1: the gradient norm is nan"):
        main([f"run_dir={tmp_path / 'g'}", *TINY, "steps=2"])
    assert not list((tmp_path / "g" / "checkpoints").glob("step_*"))


def test_resume_refuses_a_data_position_that_does_not_match(tmp_path):
    run_dir, prompts = tmp_path / "pos", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in range(3)))
    main([f"run_dir={run_dir}", *TINY, "steps=1", "save_every=1", f"data.prompts={prompts}"])
    prompts.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in range(2)))
    with pytest.raises(ValueError, match=r"data position \{'epoch': 0, 'index_in_epoch': 2\} but step 1 of these "
                                         r"prompts is at \{'epoch': 1, 'index_in_epoch': 0\}"):
        main([f"resume={run_dir}", "steps=2"])  # the prompts file lost a line (data.prompts_per_step may not change)


def test_a_fresh_run_refuses_a_used_run_dir_and_overwrite_starts_over(tmp_path):
    from flywheel.cli import USAGE_ERRORS

    run_dir = tmp_path / "used"
    main([f"run_dir={run_dir}", *TINY, "steps=1"])
    with pytest.raises(USAGE_ERRORS, match="resume=.*overwrite=true"):  # with the config, before the model loads
        main([f"run_dir={run_dir}", *TINY, "steps=1"])
    main([f"run_dir={run_dir}", *TINY, "steps=1", "overwrite=true"])
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]  # not [0, 1, 0, 1]


def test_cps_rollouts_train_with_finite_metrics_and_raise_the_reward(tmp_path):
    """Item 1: CPS's last step (std 0) never enters the loss or the KL (log_kl is on by default)."""
    result = main([f"run_dir={tmp_path / 'cps'}", "tracker=none", "sampling.sampler=cps", "sampling.noise_level=0.5",
                   "sampling.steps=4", "steps=12", "eval.every=12", "eval.seeds=2", "sample_every=1000",
                   "save_every=1000"])
    rows = read_metrics(tmp_path / "cps" / "metrics.jsonl")
    for row in rows[1:]:
        assert all(math.isfinite(row[k]) for k in ("loss", "kl", "grad_norm", "ratio/mean")), row
    assert rows[1]["ratio/max_dev"] == 0.0  # on-policy: CPS log-probs recomputed exactly
    assert result["final"]["eval/reward/mean"] > result["base"]["eval/reward/mean"] + 0.1
