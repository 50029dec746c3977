"""The GPU suite prepared on the CPU (benchmarks/gpu_suite.sh and its parts), the engine-overhead figure of
benchmarks/rollout_vs_diffusers.py, and benchmarks/reward_costs.py's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ holds scripts, not an installed package

from benchmarks.gpu_suite_merge import merge  # noqa: E402
from benchmarks.recipe_steps import step_seconds, summarize  # noqa: E402
from benchmarks.rollout_vs_diffusers import device_timer, engine_overhead  # noqa: E402


# ---- the overhead formula ----------------------------------------------------------------------------------


def test_engine_overhead_is_the_median_of_paired_round_ratios_minus_one():
    # Rounds: 1.03/1.0, 2.2/2.0, 0.99/0.9 -> 0.03, 0.1, 0.1 (median 0.1); pairing matters: the medians of the
    # two columns apart would give 1.03/1.0 - 1 = 0.03.
    got = engine_overhead([1.03, 2.2, 0.99], [1.0, 2.0, 0.9])
    assert got["median"] == pytest.approx(0.1) and got["min"] == pytest.approx(0.03)
    assert got["max"] == pytest.approx(0.1)
    assert engine_overhead([2.0], [2.0])["median"] == 0.0
    assert engine_overhead([0.5, 0.5], [1.0, 1.0])["median"] == pytest.approx(-0.5)  # faster than its forwards


def test_engine_overhead_refuses_unpaired_or_empty_timings():
    with pytest.raises(ValueError, match="one forwards time per engine time"):
        engine_overhead([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="one forwards time per engine time"):
        engine_overhead([], [])
    with pytest.raises(ValueError, match="positive"):
        engine_overhead([1.0], [0.0])


def test_device_timer_clocks():
    import time

    timed = device_timer(torch.device("cpu"))
    assert 0.02 <= timed(lambda: time.sleep(0.03)) < 1.0  # the wall clock sees a sleep
    assert device_timer(torch.device("cpu"), "process")(lambda: time.sleep(0.03)) < 0.02  # CPU seconds do not
    with pytest.raises(ValueError, match="CPU seconds"):
        device_timer(torch.device("cuda"), "process")


def test_forward_recorder_replays_the_rollouts_forwards_and_decode():
    """The recorded forwards are the transformer calls of one rollout (one per step, CFG's doubled batch), and
    replaying them decodes the very latents the rollout ended on: the forwards side does the model's work."""
    from benchmarks.rollout_vs_diffusers import FAMILIES, PROMPT, ForwardRecorder
    from engine import Engine, GenerationRequest

    family = FAMILIES["sd3"]
    _, model, pixels = family.setup(dict(num_layers=1, heads=2, head_dim=16, sample_size=16), torch.device("cpu"),
                                    torch.float32)
    engine = Engine(model)
    requests = [GenerationRequest(prompt=PROMPT, seed=i, card="sd3", steps=3, sampler="sde", noise_level=0.7,
                                  guidance_scale=4.5, height=pixels, width=pixels) for i in range(2)]
    box = {}
    recorder = ForwardRecorder(model).record(lambda: box.setdefault("traj", engine.generate(requests)))
    assert len(recorder.calls) == 3
    assert all(kwargs["hidden_states"].shape[0] == 4 for _, kwargs in recorder.calls)  # uncond + cond rows
    assert "decode" not in vars(model)  # the class's decode again
    images = recorder.replay(model.transformer)()
    assert torch.equal(images, box["traj"].images)
    # The recorded inputs are copies: the third call's latents are the rollout's state before the last step.
    assert torch.equal(recorder.calls[2][1]["hidden_states"][2:], box["traj"].latents[:, 2])


# ---- the sync-debug part -------------------------------------------------------------------------------------


def test_sync_debug_part_on_cpu_runs_the_loop_guarded_without_setting_the_mode(tmp_path, monkeypatch):
    from benchmarks import sync_debug

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(mode))
    got = sync_debug.main(["--quick", "--sides", "eager", "--json", str(tmp_path / "s.json")])
    assert got["sync_free"] is True and got["eager_sync_free"] is True and got["sync_debug_mode_set"] is False
    assert "CUDA unavailable" in got["sync_debug_note"] and modes == []
    assert json.loads((tmp_path / "s.json").read_text())["eager_sync_free"] is True


def test_sync_debug_part_reports_a_host_read_inside_the_loop(monkeypatch):
    """A loop that reads a tensor on the host (as a synchronising loop would) is reported, not passed."""
    import engine.denoise
    from benchmarks import sync_debug

    original = engine.denoise.denoise

    def leaky(*args, **kwargs):
        args[2].sum().item()  # the initial noise read back
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.denoise, "denoise", leaky)
    got = sync_debug.main(["--quick", "--sides", "eager"])
    assert got["eager_sync_free"] is False and got["sync_free"] is False
    assert "HostTransferError" in got["eager_error"] and "item" in got["eager_error"]


def test_sync_debug_mode_is_set_and_restored_only_with_cuda(monkeypatch):
    from benchmarks.sync_debug import sync_debug_error

    calls = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: calls.append(mode))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    with sync_debug_error(cuda=False):
        pass
    assert calls == []
    with sync_debug_error(cuda=True):
        assert calls == ["error"]
    assert calls == ["error", 0]


# ---- the recipes part and the merge --------------------------------------------------------------------------


def test_recipe_steps_summary_from_metrics_rows():
    rows = [{"step": 0, "time/wall_s": 0.0},
            {"step": 1, "time/rollout_s": 9.0, "time/train_s": 5.0, "ratio/max_dev": 0.0},
            {"step": 2, "time/rollout_s": 2.0, "time/train_s": 1.0, "ratio/max_dev": 0.0},
            {"step": 3, "time/rollout_s": 4.0, "time/train_s": 3.0, "ratio/max_dev": 0.0}]
    got = summarize("grpo", rows, 3 * 2**20)
    assert got["grpo_rollout_s"] == 3.0 and got["grpo_train_s"] == 2.0  # medians of steps 2..3: warm-up left out
    assert got["grpo_peak_mb"] == 3.0 and got["grpo_ratio_max_dev"] == 0.0 and got["grpo_on_policy_exact"] is True
    rows[2]["ratio/max_dev"] = 3e-6
    assert summarize("grpo", rows, 0)["grpo_on_policy_exact"] is False
    assert "grpo_ratio_max_dev" not in summarize("nft", rows, 0)
    assert step_seconds(rows[:2], "time/rollout_s") == 9.0  # one step: that step
    with pytest.raises(ValueError, match="time/train_s"):
        step_seconds([{"step": 0}], "time/train_s")


def test_merge_prefixes_each_part_and_records_failures(tmp_path):
    (tmp_path / "rollout.json").write_text(json.dumps({"engine_overhead_eager": 0.02, "family": "sd3"}))
    (tmp_path / "rollout.status").write_text("0 12\n")
    (tmp_path / "recipes.status").write_text("124 180\n")  # killed by its timeout before writing anything
    (tmp_path / "sync_debug.json").write_text(json.dumps({"sync_free": True}))
    (tmp_path / "sync_debug.status").write_text("1 3\n")  # wrote its JSON, then failed
    (tmp_path / "weight_sync.json").write_text(json.dumps({"nested": {"no": 1}}))
    (tmp_path / "weight_sync.status").write_text("0 4\n")
    got = merge(tmp_path, ["rollout", "recipes", "sync_debug", "weight_sync"])
    assert got["rollout.engine_overhead_eager"] == 0.02 and got["rollout.ok"] is True and got["rollout.seconds"] == 12
    assert got["recipes.ok"] is False and got["recipes.exit"] == 124 and "timeout" in got["recipes.error"]
    assert got["sync_debug.ok"] is False and got["sync_debug.error"] == "exit 1" and got["sync_debug.sync_free"]
    assert got["weight_sync.ok"] is False and "unreadable" in got["weight_sync.error"]
    assert got["parts_ok"] == 1 and got["all_ok"] is False


def test_suite_refuses_an_unknown_argument_or_part():
    for args in (["--dry-run", "--bogus"], ["--dry-run", "--parts", "nothing"]):
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), *args], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 2 and "gpu_suite.sh:" in proc.stderr


@pytest.mark.slow
def test_gpu_suite_dry_run_writes_every_part(tmp_path):
    """The whole suite on the CPU, tiny sizes (about one CPU-minute): every part's JSON and the merged one."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert merged["all_ok"] is True and merged["parts"] == ["rollout", "recipes", "sync_debug", "weight_sync"]
    for part in merged["parts"]:
        assert json.loads((tmp_path / f"{part}.json").read_text()), part
    assert merged["rollout.engine_overhead_eager"] > -1 and "rollout.engine_overhead_compiled" in merged
    assert all(merged[f"recipes.{r}_ok"] for r in ("grpo", "nft", "awm", "dpo", "draft"))
    assert merged["recipes.grpo_on_policy_exact"] is True  # eager bf16 on the CPU: the same kernels recomputed
    assert merged["sync_debug.sync_free"] is True and merged["sync_debug.sync_debug_mode_set"] is False


# ---- reward costs --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_reward_costs_quick_measures_every_scorer_of_the_docs_table(tmp_path):
    import importlib.util

    from benchmarks.reward_costs import QWEN2_VL_7B_PARAMS, main

    got = main(["--quick", "--json", str(tmp_path / "c.json")])
    rows = ["digit_alignment", "number_alignment", "jpeg_compressibility", "clip_score", "pickscore", "aesthetic",
            "clip_score_video", "pickscore_video", "aesthetic_video", "audio_loudness", "av_onset_sync", "hpsv3"]
    if importlib.util.find_spec("rapidocr") is not None:
        rows.append("ocr")
    else:
        assert "rapidocr" in got["ocr_skipped"]
    for row in rows:
        assert got[f"{row}_s_per_image"] > 0, row
    assert "TINY" in got["hpsv3_input"]
    assert got["hpsv3_real_over_tiny_params"] == pytest.approx(QWEN2_VL_7B_PARAMS / got["hpsv3_tiny_params"])
    assert json.loads((tmp_path / "c.json").read_text()) == got


def test_reward_costs_only_times_the_named_rows_and_refuses_unknown_ones(tmp_path, capsys):
    from benchmarks.reward_costs import main

    got = main(["--quick", "--only", "digit_alignment,audio_loudness"])
    assert {k for k in got if k.endswith("_s_per_image")} == {"digit_alignment_s_per_image",
                                                             "audio_loudness_s_per_image"}
    with pytest.raises(SystemExit):
        main(["--quick", "--only", "digit_alignment,pickscor"])
    assert "unknown rows ['pickscor']" in capsys.readouterr().err
