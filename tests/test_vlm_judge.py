"""vlm_judge: a VLM over an OpenAI-compatible API as reward and judge, against a local server (tests/vlm_server.py)."""

import math
import time

import pytest
import torch

pytest.importorskip("openai", reason="vlm_judge needs the openai client: pip install -e .[vlm]")

from flywheel.runs.rundir import read_metrics
from rewards import RewardSet
from rewards.digits import DigitAlignment, digit_split
from rewards.vlm_judge import VlmJudge, json_score, rubric_score, yes_no_score, SCORE_PATTERN
from trainers.grpo import main

from recipe_kill import negate_advantages
from vlm_server import JudgeServer

import re


@pytest.fixture
def server():
    with JudgeServer() as s:
        yield s


def digits(n=6):
    x_train, _, y_train, _ = digit_split()
    images = torch.tensor(x_train[:n] / 16.0, dtype=torch.float32)[:, None]
    return images, [f"the digit {int(d)}" for d in y_train[:n]], [int(d) for d in y_train[:n]]


def test_vlm_yes_no_folds_case_variants_and_bounds_a_missing_side():
    # "Yes" and " yes" are one answer: logsumexp(log .2, log .1) = log .3 against No's log .6.
    top = [("No", math.log(0.6)), ("Yes", math.log(0.2)), (" yes", math.log(0.1)), ("x", math.log(0.05))]
    assert yes_no_score(top) == pytest.approx(0.3 / 0.9, abs=1e-12)
    # No is absent: bounded by the least likely listed token (0.05) and by the unlisted mass (1 - 0.95).
    top = [("YES", math.log(0.9)), ("x", math.log(0.05))]
    assert yes_no_score(top) == pytest.approx(0.9 / 0.95, abs=1e-12)
    top = [("yes.", math.log(0.5)), ("a", math.log(0.3)), ("b", math.log(0.15))]  # rest 0.05 < 0.15
    assert yes_no_score(top) == pytest.approx(0.5 / 0.55, abs=1e-12)
    with pytest.raises(ValueError, match="neither Yes nor No"):
        yes_no_score([("Maybe", -0.1), ("Perhaps", -3.0)])
    # Positive "log-probabilities" are garbage: read as ones they made a confident 0.9975.
    with pytest.raises(ValueError, match=r"positive values \[\('Yes', 5\)\], which are no log-probabilities"):
        yes_no_score([("Yes", 5), ("No", -1)])
    assert yes_no_score([("Yes", 1e-6), ("No", -30.0)]) == pytest.approx(1.0)  # rounding above 0 is no error


def test_vlm_score_and_json_replies_map_their_range_onto_0_1():
    pattern = re.compile(SCORE_PATTERN)
    assert rubric_score("good.\nFinal Score: 4", pattern, (1, 5)) == 0.75
    assert rubric_score("Final Score: 2\n... revised. Final Score: **5**", pattern, (1, 5)) == 1.0  # the last one
    assert rubric_score("Final Score: 4.", pattern, (1, 5)) == 0.75  # a sentence's full stop ends the number
    assert rubric_score("Final Score: 4.5/5", pattern, (1, 5)) == 0.875
    # none, outside the rubric, or a number the pattern would cut short (1e3 read as 1): unparsable, not clamped
    for bad in ("no number here", "Final Score: 7", "Final Score: 1e3", "Final Score: 2.5.1", "Final Score: 1E-2"):
        with pytest.raises(ValueError):
            rubric_score(bad, pattern, (1, 5))
    assert json_score('{"score": 2.5}', (0, 10)) == 0.25
    assert json_score('Sure!\n```json\n{"score": 8}\n```', (0, 10)) == 0.8
    for bad in ('{"rating": 3}', '{"score": "high"}', '{"score": true}', "8/10"):
        with pytest.raises(ValueError):
            json_score(bad, (0, 10))


def test_vlm_bad_settings_are_one_line_errors(server, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_VLM_URL", raising=False)
    with pytest.raises(ValueError, match="base_url"):
        VlmJudge()
    with pytest.raises(ValueError, match="mode 'likert'.*yes_no, score, json"):
        VlmJudge(base_url=server.base_url, mode="likert")
    with pytest.raises(ValueError, match="top_logprobs"):
        VlmJudge(base_url=server.base_url, top_logprobs=5)
    with pytest.raises(ValueError, match="template"):
        VlmJudge(base_url=server.base_url, prompt="rate {image}")
    with pytest.raises(ValueError, match="score_range"):
        VlmJudge(base_url=server.base_url, mode="score", score_range=(5, 1))
    for key, value, valid in [("max_tokens", -5, "an integer >= 1 or null"), ("max_tokens", "x", "an integer >= 1"),
                              ("max_tokens", 2.0, "an integer >= 1"), ("backoff_s", True, "a finite number of "
                              "seconds >= 0"), ("temperature", -1, "a finite number >= 0"),
                              ("temperature", "hot", "a finite number >= 0")]:
        with pytest.raises(ValueError, match=f"vlm_judge {key} must be {valid}.*, got {re.escape(repr(value))}$"):
            VlmJudge.check_args(base_url=server.base_url, **{key: value})  # as the checks before a run call it
    with pytest.raises(RuntimeError, match="could not list the models"):
        VlmJudge(base_url="http://127.0.0.1:9/v1", timeout_s=2)


@pytest.mark.parametrize("mode", ["yes_no", "score", "json"])
def test_vlm_every_mode_reads_the_servers_verdict(server, mode):
    """The server's p is the digit CNN's probability (of the PNG the judge sent): every mode must recover it."""
    images, prompts, _ = digits()
    prompts[1] = "the digit 3" if prompts[1] != "the digit 3" else "the digit 4"  # one wrong prompt
    judge = VlmJudge(base_url=server.base_url, mode=mode)
    assert judge.model == "toy-vlm"  # the server's first listed model
    expected = DigitAlignment()((images * 255).round() / 255, prompts, [{}] * len(prompts))
    scores = judge(images, prompts, [{}] * len(prompts))
    assert torch.allclose(scores, expected, atol=2e-4)  # the rubric and JSON replies are rounded to 4 places
    assert scores[1] < 0.5 < scores[0]
    body = server.requests[-1]
    assert body["model"] == "toy-vlm" and body["messages"][-1]["content"][0]["image_url"]["url"].startswith(
        "data:image/png;base64,")
    assert (body.get("top_logprobs"), body["max_tokens"]) == ((20, 1) if mode == "yes_no" else (None, body["max_tokens"]))
    assert judge.counts == {"scored": len(prompts)}


def test_vlm_video_frames_are_k_evenly_spaced_frames_in_one_request(server):
    images, prompts, _ = digits(2)
    # Frame f of video b is the digit image scaled by (f + 1) / 8: which frames went is readable from their mean.
    videos = torch.stack([images * (f + 1) / 8 for f in range(8)], dim=2)  # [B, 1, 8, 8, 8]
    judge = VlmJudge(base_url=server.base_url, video_frames=4)
    assert judge.wants_video
    rewards = RewardSet("vlm_judge", scorer_kwargs={"vlm_judge": {"base_url": server.base_url, "video_frames": 4}})
    batch = rewards.score(videos[:, :, 4], prompts, None, 0, videos=videos)
    assert batch.valid.all()
    content = server.requests[-1]["messages"][-1]["content"]
    from vlm_server import decode
    sent = [decode(part["image_url"]["url"]) for part in content if part["type"] == "image_url"]
    assert len(sent) == 4
    # Frames 1, 3, 5, 7 of 8 (span centres): brightness (f + 1) / 8 of the digit.
    scale = [float(s.mean() / images[-1].mean()) for s in sent]
    assert scale == pytest.approx([2 / 8, 4 / 8, 6 / 8, 8 / 8], abs=0.01)


def test_vlm_failed_or_unparsable_replies_are_masked_and_counted_never_zero(server):
    images, prompts, _ = digits(4)
    rewards = RewardSet("vlm_judge", scorer_kwargs={"vlm_judge": {
        "base_url": server.base_url, "retries": 1, "backoff_s": 0.05, "timeout_s": 5}})
    judge = rewards.scorers["vlm_judge"]
    server.behaviour = "garbage"
    batch = rewards.score(images, prompts, None, 0)
    assert not batch.valid.any() and torch.isnan(batch.total).all()
    assert batch.metrics()["reward/vlm_judge/invalid"] == 4.0
    assert judge.counts["unparsable"] == 4
    server.behaviour = "error"  # HTTP 500: retried once, then masked
    seen = len(server.requests)
    batch = rewards.score(images, prompts, None, 0)
    assert not batch.valid.any() and len(server.requests) - seen == 8
    assert judge.counts["InternalServerError"] == 4
    server.behaviour = "ok"
    assert rewards.score(images, prompts, None, 0).valid.all()
    assert judge.counts["scored"] == 4


def test_vlm_timeout_and_budget_bound_a_slow_server(server):
    images, prompts, _ = digits(4)
    server.behaviour, server.delay_s = "slow", 5.0
    judge = VlmJudge(base_url=server.base_url, timeout_s=0.3, budget_s=1.0, retries=5, backoff_s=0.1)
    start = time.monotonic()
    scores = judge(images, prompts, [{}] * 4)
    assert time.monotonic() - start < 2.5  # the batch's budget, not 4 samples x 6 attempts x 5 s
    assert torch.isnan(scores).all() and judge.counts["TimeoutError"] == 4
    # Bounded concurrency: with 2 calls in flight and 0.3 s each, 4 samples cannot all start at once.
    server.delay_s = 0.3
    judge = VlmJudge(base_url=server.base_url, max_concurrency=2, timeout_s=5, budget_s=10)
    start = time.monotonic()
    assert torch.isfinite(judge(images, prompts, [{}] * 4)).all()
    assert time.monotonic() - start >= 0.6


def test_vlm_api_key_comes_from_the_environment(monkeypatch):
    images, prompts, _ = digits(2)
    with JudgeServer(api_key="sekrit") as keyed:
        monkeypatch.setenv("MY_VLM_KEY", "sekrit")
        judge = VlmJudge(base_url=keyed.base_url, model="toy-vlm", api_key_env="MY_VLM_KEY", retries=0)
        assert torch.isfinite(judge(images, prompts, [{}] * 2)).all()
        monkeypatch.setenv("MY_VLM_KEY", "wrong")
        judge = VlmJudge(base_url=keyed.base_url, model="toy-vlm", api_key_env="MY_VLM_KEY", retries=0)
        assert torch.isnan(judge(images, prompts, [{}] * 2)).all() and judge.counts["AuthenticationError"] == 2


def test_vlm_is_an_evaluation_only_judge_of_a_run(server, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLM_URL", server.base_url)
    result = main([f"run_dir={tmp_path / 'j'}", "tracker=none", "steps=1", "eval.every=1", "eval.seeds=1",
                   "data.prompts_per_step=2", "data.group_size=4", "save_every=1000", "sample_every=1000",
                   "eval.judges=vlm_judge"])
    rows = read_metrics(tmp_path / "j" / "metrics.jsonl")
    assert "reward/vlm_judge/mean" not in rows[1]  # not a reward
    # The judge's mean over the evaluation tracks the CNN reward of the same samples (it is the CNN, via PNG).
    for row in (rows[0], rows[-1]):
        assert row["eval/judge/vlm_judge/mean"] == pytest.approx(row["eval/reward/mean"], abs=0.01)
    assert result["final"]["eval/judge/vlm_judge/mean"] == rows[-1]["eval/judge/vlm_judge/mean"]


GRPO = ["tracker=none", "eval.seeds=1", "train.timestep_fraction=0.5", "save_every=1000",
        "sample_every=1000", "reward.scorers=vlm_judge", "data.prompts_per_step=8", "data.group_size=8"]


@pytest.mark.slow
def test_vlm_grpo_raises_the_judges_reward_and_the_negated_control_lowers_it(server, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLM_URL", server.base_url)
    # Measured (eval every 4 steps of 20, 2026-12-07): 0.367 -> 0.516 at step 12 (0.765 at 20), negated 0.252.
    steps = ["steps=12", "eval.every=12"]
    real = main([f"run_dir={tmp_path / 'real'}", *GRPO, *steps])
    negate_advantages(monkeypatch)
    control = main([f"run_dir={tmp_path / 'negated'}", *GRPO, *steps])
    base = real["base"]["eval/reward/mean"]
    assert control["base"]["eval/reward/mean"] == base
    assert real["final"]["eval/reward/mean"] > base + 0.08
    assert control["final"]["eval/reward/mean"] < base - 0.05
    rows = read_metrics(tmp_path / "real" / "metrics.jsonl")
    assert all(r["reward/vlm_judge/invalid"] == 0.0 for r in rows[1:])


class StopServer:
    """Wraps VlmJudge.__call__: the server goes away before call `stop_at` and comes back before `back_at`."""

    def __init__(self, server, stop_at, back_at=None):
        self.server, self.stop_at, self.back_at, self.calls = server, stop_at, back_at, 0

    def install(self, monkeypatch):
        original = VlmJudge.__call__

        def call(judge, *args, **kwargs):
            self.calls += 1
            if self.calls == self.stop_at:
                self.server.stop()
            if self.calls == self.back_at:
                self.server.restart()
            return original(judge, *args, **kwargs)

        monkeypatch.setattr(VlmJudge, "__call__", call)


def test_vlm_judge_server_stopped_mid_run_masks_those_steps_and_the_run_finishes(server, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLM_URL", server.base_url)
    # Calls: 1 base evaluation, then steps 1..5 (calls 2..6), then the final evaluation: steps 2 and 3 go unjudged.
    StopServer(server, stop_at=3, back_at=5).install(monkeypatch)
    main([f"run_dir={tmp_path / 'gap'}", *GRPO, "steps=5", "eval.every=5", "data.prompts_per_step=2",
          "data.group_size=4"])
    rows = read_metrics(tmp_path / "gap" / "metrics.jsonl")
    assert [r["reward/vlm_judge/invalid"] for r in rows[1:]] == [0.0, 8.0, 8.0, 0.0, 0.0]  # NaN is null in the file
    assert rows[2]["reward/mean"] is None and rows[3]["train/skipped_steps"] == 2
    assert math.isfinite(rows[-1]["eval/reward/mean"])


def test_vlm_judge_server_gone_for_good_stops_the_run_at_the_masked_step_limit(server, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLM_URL", server.base_url)
    StopServer(server, stop_at=3).install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"step 4: the rewards masked every sample of the last 3 steps"):
        main([f"run_dir={tmp_path / 'gone'}", *GRPO, "steps=8", "eval.every=8", "data.prompts_per_step=2",
              "data.group_size=4"])
