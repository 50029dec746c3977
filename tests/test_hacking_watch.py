"""Reward hacking watch: per-class judge and reward metrics, the reward-up/judge-down watch, the verdict grid."""

import math

import numpy as np
import pytest
import torch

from flywheel.grids import AGREE, DISAGREE, GAP, NO_VERDICT, judged_sample_grid, make_verdict_grid
from flywheel.hacking_watch import HackingWatch
from flywheel.rollout_collector import class_means, eval_samples
from flywheel.runs.rundir import make_image_grid
from flywheel.prompts import PromptItem
from rewards import RewardSet
from rewards.digits import DigitAlignment, digit_split
from rewards.judges import DigitJudge, Verdict

# ---- per-class metrics in eval_samples ----

ITEMS = [PromptItem("a handwritten three", {"digit": 3}), PromptItem("the digit three", {"digit": 3}),
         PromptItem("a handwritten six", {"digit": 6}), PromptItem("a picture", {})]
EVAL_KWARGS = {"steps": 2, "sampler": "ode"}


class MeanPixelJudge:
    """A judge whose score is easy to recompute: each image's mean pixel; classes from metadata "digit"."""

    def __call__(self, images, prompts, metadata):
        return images.flatten(1).mean(1)

    def classes(self, prompts, metadata):
        return [m.get("digit") for m in metadata]


class MaxPixelJudge:
    """A judge that declares no classes: it is broken down by the classes another judge declares."""

    def __call__(self, images, prompts, metadata):
        return images.flatten(1).amax(1)


def test_evaluate_reports_judge_and_reward_per_class(toy_engine):
    judges = {"pix": MeanPixelJudge(), "peak": MaxPixelJudge()}
    metrics, traj = eval_samples(toy_engine, RewardSet("digit_alignment"), ITEMS, 2, EVAL_KWARGS, judges)

    # Hand computation: rows 0-3 are digit 3 (two prompts x two seeds), 4-5 digit 6, 6-7 no class.
    images = traj.images.float()
    mean_pix, max_pix = images.flatten(1).mean(1), images.flatten(1).amax(1)
    reward = DigitAlignment()(traj.images, traj.prompts, traj.metadata)
    assert metrics["eval/judge/pix/3"] == pytest.approx(float(mean_pix[:4].mean()), abs=1e-6)
    assert metrics["eval/judge/pix/6"] == pytest.approx(float(mean_pix[4:6].mean()), abs=1e-6)
    assert metrics["eval/judge/peak/3"] == pytest.approx(float(max_pix[:4].mean()), abs=1e-6)
    assert metrics["eval/judge/peak/6"] == pytest.approx(float(max_pix[4:6].mean()), abs=1e-6)
    assert metrics["eval/judge/pix/min_class"] == pytest.approx(min(float(mean_pix[:4].mean()),
                                                                    float(mean_pix[4:6].mean())), abs=1e-6)
    assert metrics["eval/reward/3"] == pytest.approx(float(reward[:4].mean()), abs=1e-6)
    assert metrics["eval/reward/6"] == pytest.approx(float(reward[4:6].mean()), abs=1e-6)
    # The existing keys stay: the overall judge mean covers every row, the class-less ones too.
    assert metrics["eval/judge/pix/mean"] == pytest.approx(float(mean_pix.mean()), abs=1e-6)
    assert "eval/reward/mean" in metrics and "eval/reward/digit_alignment/mean" in metrics
    assert not any(k.endswith("/None") for k in metrics)

    # A task without classes (no judge declares any) gets no per-class keys.
    plain, _ = eval_samples(toy_engine, RewardSet("digit_alignment"), ITEMS[:1], 1, EVAL_KWARGS, {"peak": MaxPixelJudge()})
    assert sorted(k for k in plain if "judge" in k) == ["eval/judge/peak/mean"]
    assert "eval/reward/3" not in plain


def test_evaluate_logs_the_pixel_std_across_each_prompts_seeds_as_eval_diversity(toy_engine):
    """eval/diversity: per prompt, the per-pixel std (population) over its seeds, averaged over pixels, then prompts;
    0 when every seed of a prompt gives one image (the collapse a sample grid shows); absent with one seed."""
    metrics, traj = eval_samples(toy_engine, RewardSet("digit_alignment"), ITEMS, 3, EVAL_KWARGS)
    images = traj.images.double().flatten(1)  # prompt-major: rows 3p..3p+2 are prompt p's seeds
    per_prompt = []
    for p in range(len(ITEMS)):
        seeds = images[3 * p:3 * p + 3]
        mean = seeds.mean(0)
        per_prompt.append(float(((seeds - mean) ** 2).mean(0).sqrt().mean()))
    assert metrics["eval/diversity"] == pytest.approx(sum(per_prompt) / len(per_prompt), rel=1e-5)
    assert metrics["eval/diversity"] > 0.01  # different seeds give different digits
    one_seed, _ = eval_samples(toy_engine, RewardSet("digit_alignment"), ITEMS, 1, EVAL_KWARGS)
    assert "eval/diversity" not in one_seed


def test_class_means_leave_out_invalid_and_classless_rows():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    means = class_means(values, [3, 3, 6, None, 8], valid=torch.tensor([True, False, True, True, False]))
    assert list(means) == ["3", "6", "8"] and means["3"] == 1.0 and means["6"] == 3.0
    assert math.isnan(means["8"])  # no valid row: NaN, as RewardBatch.metrics gives an empty mean


def test_evaluate_reward_per_class_leaves_out_invalid_rewards(toy_engine):
    class StyleJudge(MeanPixelJudge):
        def classes(self, prompts, metadata):
            return [m["style"] for m in metadata]

    # "a picture" names no digit: digit_alignment masks its rows, and the class mean must skip them.
    items = [PromptItem("a handwritten three", {"digit": 3, "style": "neat"}),
             PromptItem("a picture", {"style": "neat"})]
    metrics, traj = eval_samples(toy_engine, RewardSet("digit_alignment"), items, 2, EVAL_KWARGS, {"s": StyleJudge()})
    reward = DigitAlignment()(traj.images, traj.prompts, traj.metadata)
    assert metrics["eval/reward/invalid"] == 2.0
    assert metrics["eval/reward/neat"] == pytest.approx(float(reward[:2].mean()), abs=1e-6)


class _NoGenerate:
    card_id = "toy-digits"

    def generate(self, requests):
        raise AssertionError("eval_samples generated before rejecting its classes")


@pytest.mark.parametrize("bad_class, expected", [("mean", "mean"), ("a/b", "'/'"), (2.5, "int or a str")])
def test_evaluate_rejects_a_class_that_cannot_name_a_metric_before_generating(bad_class, expected):
    class Judge(MeanPixelJudge):
        def classes(self, prompts, metadata):
            return [bad_class] * len(prompts)

    with pytest.raises(ValueError, match="judge 'j'") as err:
        eval_samples(_NoGenerate(), RewardSet("digit_alignment"), ITEMS[:1], 1, EVAL_KWARGS, {"j": Judge()})
    assert expected in str(err.value)


def test_evaluate_stops_when_a_judge_leaves_a_class_sample_unscored(toy_engine):
    class HalfJudge(MeanPixelJudge):
        def __call__(self, images, prompts, metadata):
            scores = super().__call__(images, prompts, metadata)
            scores[1] = math.nan  # row 1 is a digit-3 sample
            return scores

    with pytest.raises(ValueError, match=r"judge 'half' gave a non-finite score to 1 sample"):
        eval_samples(toy_engine, RewardSet("digit_alignment"), ITEMS, 2, EVAL_KWARGS, {"half": HalfJudge()})


def test_evaluate_rejects_judges_that_disagree_on_classes():
    class Other(MeanPixelJudge):
        def classes(self, prompts, metadata):
            return [7 for _ in prompts]

    with pytest.raises(ValueError, match="'a' and 'b' put the evaluation samples in different classes"):
        eval_samples(_NoGenerate(), RewardSet("digit_alignment"), ITEMS, 1, EVAL_KWARGS,
                 {"a": MeanPixelJudge(), "b": Other()})


# ---- the watch ----

def eval_row(reward, judge, per_class=None):
    """Metrics as eval_samples writes them; per_class maps a class to (reward, judge)."""
    row = {"eval/reward/mean": reward, "eval/reward/std": 0.1, "eval/reward/digit_alignment/mean": reward,
           "eval/judge/svc/mean": judge}
    for c, (r, j) in (per_class or {}).items():
        row[f"eval/reward/{c}"], row[f"eval/judge/svc/{c}"] = r, j
    if per_class:
        row["eval/judge/svc/min_class"] = min(j for _, j in per_class.values())
    return row


def test_watch_fires_when_one_class_reward_rises_while_its_judge_falls():
    watch = HackingWatch(tolerance=0.05)
    first = watch.observe(eval_row(0.50, 0.60, {3: (0.50, 0.60), 6: (0.50, 0.60)}), step=0)
    second = watch.observe(eval_row(0.85, 0.88, {3: (0.80, 0.85), 6: (0.90, 0.91)}), step=40)
    # Digit 6 turns into a blob the reward loves and the judge rejects (3 starts to, less); the overall
    # judge barely moves.
    third = watch.observe(eval_row(0.95, 0.86, {3: (0.92, 0.72), 6: (0.99, 0.62)}), step=80)
    assert first.warning is None and second.warning is None
    assert first.metrics == {"eval/hacking_warning": 0.0, "eval/hacking_signals": 0.0}
    assert [(s.judge, s.cls) for s in third.signals] == [("svc", "6"), ("svc", "3")]  # the largest fall first
    assert third.warning == ("possible reward hacking: judge svc fell 0.91->0.62 on class 6 since step 40 "
                             "while reward rose 0.90->0.99 (and 1 more)")
    assert third.short == "svc 6 0.91->0.62"
    assert third.metrics == {"eval/hacking_warning": 1.0, "eval/hacking_signals": 2.0}
    assert third.new and watch.last is third
    # Still hacked at the next evaluation: still a warning, but not a new one (printed once).
    fourth = watch.observe(eval_row(0.97, 0.85, {3: (0.94, 0.91), 6: (1.0, 0.55)}), step=100)
    assert fourth.signals[0].cls == "6" and fourth.signals[0].judge_before == 0.91 and not fourth.new


def test_watch_fires_on_the_overall_means_too():
    watch = HackingWatch(tolerance=0.05)
    watch.observe(eval_row(0.6, 0.9), step=20)
    result = watch.observe(eval_row(0.9, 0.7), step=40)
    assert [(s.judge, s.cls) for s in result.signals] == [("svc", None)]
    assert "overall since step 20" in result.warning


def test_watch_catches_a_slow_slide_from_the_best_judge_value():
    # Each step is within the tolerance; the judge's fall from its best value is not.
    watch = HackingWatch(tolerance=0.05)
    results = [watch.observe(eval_row(0.5 + 0.04 * i, 0.9 - 0.03 * i), step=10 * i) for i in range(4)]
    assert [r.warning is not None for r in results] == [False, False, True, True]
    assert results[2].signals[0].judge_before == 0.9 and results[2].signals[0].since_step == 0


def test_watch_compares_with_the_previous_evaluation_after_a_dip():
    # Since the best judge value the reward fell; since the previous evaluation it rose.
    watch = HackingWatch(tolerance=0.05)
    for step, (reward, judge) in enumerate([(0.95, 0.90), (0.80, 0.70), (0.90, 0.60)]):
        result = watch.observe(eval_row(reward, judge), step=step)
    assert str(result.signals[0]) == "judge svc fell 0.70->0.60 overall since step 1 while reward rose 0.80->0.90"


@pytest.mark.parametrize("sequence", [
    [(0.5, 0.6, 0.5, 0.6), (0.7, 0.75, 0.8, 0.8), (0.9, 0.9, 0.95, 0.92)],    # both rise
    [(0.5, 0.9, 0.5, 0.9), (0.54, 0.88, 0.6, 0.87), (0.58, 0.89, 0.7, 0.86)],  # judge dips within tolerance
    [(0.9, 0.9, 0.9, 0.9), (0.9, 0.6, 0.88, 0.6)],                            # judge falls, reward does not rise
])
def test_watch_stays_silent_without_a_reward_rise_against_a_judge_fall(sequence):
    # Overall means and class 6 as (reward, judge, reward of 6, judge of 6) at successive evaluations.
    watch = HackingWatch(tolerance=0.05)
    for step, (reward, judge, r6, j6) in enumerate(sequence):
        result = watch.observe(eval_row(reward, judge, {6: (r6, j6)}), step=step)
        assert result.warning is None and result.metrics["eval/hacking_warning"] == 0.0, result.warning


def test_watch_ignores_non_finite_values_and_rejects_bad_tolerance():
    watch = HackingWatch(tolerance=0.05)
    watch.observe(eval_row(0.5, 0.9), step=0)
    assert watch.observe(eval_row(0.9, math.nan), step=1).warning is None  # no evidence either way
    assert watch.observe(eval_row(0.9, 0.6), step=2).signals[0].since_step == 0  # the NaN left no trace
    for bad in (-0.1, math.nan, "0.05", True):
        with pytest.raises(ValueError, match="^tolerance must be a finite number >= 0"):
            HackingWatch(tolerance=bad)
        with pytest.raises(ValueError, match="^class_tolerance must be a finite number >= 0"):
            HackingWatch(class_tolerance=bad)


def test_watch_gives_a_class_its_own_wider_tolerance():
    # A class mean is over a tenth of the samples: a 0.07 fall there is within eval noise by default.
    rows = [eval_row(0.80, 0.90, {1: (0.69, 0.91)}), eval_row(0.85, 0.91, {1: (0.75, 0.84)})]
    default, strict = HackingWatch(), HackingWatch(class_tolerance=0.05)
    assert [default.observe(r, step=i).warning for i, r in enumerate(rows)] == [None, None]
    assert [strict.observe(r, step=i).warning is not None for i, r in enumerate(rows)] == [False, True]
    assert strict.last.signals[0].cls == "1"


# ---- the judge's verdicts and the annotated grid ----

@pytest.fixture(scope="module")
def judge():
    return DigitJudge()


def test_digit_judge_verdicts_name_the_seen_digit_and_its_probability(judge):
    _, x_test, _, y_test = digit_split()
    images = torch.from_numpy(x_test[:30] / 16.0).float()[:, None]
    metadata = [{"digit": int(d)} for d in y_test[:30]]
    metadata[0] = {"digit": (int(y_test[0]) + 1) % 10}  # a prompt the image does not show
    prompts = [""] * 29 + ["a picture"]
    metadata[29] = {}  # names no digit
    verdicts = judge.verdicts(images, prompts, metadata)
    probs = judge.probs(images)
    assert [v.predicted for v in verdicts] == probs.argmax(1).tolist()
    assert [v.score for v in verdicts] == pytest.approx(probs.max(1).values.tolist())
    assert verdicts[0].agrees is False and verdicts[29].agrees is None and verdicts[29].expected is None
    assert sum(v.agrees is True for v in verdicts[1:29]) >= 25  # the judge reads real digits (>90% accuracy)
    assert Verdict(6, 0.934, 6).label == "6:93%"
    assert judge.classes(["the digit seven", "a picture"], [{}, {}]) == [7, None]


def _frame_pixel(grid, index, ncol, h, w, upscale=4, border=2, gap=2, strip=0):
    r, k = divmod(index, ncol)
    x0, y0 = gap + k * (w * upscale + 2 * border + gap), gap + r * (h * upscale + 2 * border + strip + gap)
    return x0, y0


def test_verdict_grid_frames_each_image_in_its_verdict_colour():
    images = torch.linspace(0, 1, 5)[:, None, None, None].expand(5, 1, 8, 8).contiguous()
    agrees = [True, False, None, True, False]
    grid = make_verdict_grid(images, agrees, nrow=3)
    a = np.asarray(grid)
    cell_w, cell_h = 8 * 4 + 4, 8 * 4 + 4
    assert grid.mode == "RGB" and grid.size == (2 + 3 * (cell_w + 2), 2 + 2 * (cell_h + 2))
    for i, verdict in enumerate(agrees):
        x0, y0 = _frame_pixel(grid, i, 3, 8, 8)
        expected = {True: AGREE, False: DISAGREE, None: NO_VERDICT}[verdict]
        for x, y in ((x0, y0), (x0 + cell_w - 1, y0 + cell_h - 1), (x0 + 1, y0 + cell_h // 2)):
            assert tuple(a[y, x]) == expected, (i, x, y)
        # Inside the frame the image itself, mapped as make_image_grid maps it.
        value = round(float(images[i, 0, 0, 0]) * 255)
        assert tuple(a[y0 + 2, x0 + 2]) == (value,) * 3 and tuple(a[y0 + 33, x0 + 33]) == (value,) * 3
        assert tuple(a[y0 - 1, x0 - 1]) == GAP
    # The sixth slot (row 1, column 2) is empty: gap colour only.
    x0, y0 = _frame_pixel(grid, 5, 3, 8, 8)
    assert (a[y0:y0 + cell_h, x0:x0 + cell_w] == np.array(GAP, np.uint8)).all()


def test_verdict_grid_draws_labels_on_a_strip_in_the_frame_colour(judge):
    _, x_test, _, y_test = digit_split()
    images = torch.from_numpy(x_test[:2] / 16.0).float()[:, None]
    verdicts = judge.verdicts(images, ["", ""], [{"digit": int(y_test[0])}, {"digit": (int(y_test[1]) + 1) % 10}])
    grid = make_verdict_grid(images, [v.agrees for v in verdicts], [v.label for v in verdicts], nrow=2)
    a = np.asarray(grid)
    strip = grid.size[1] - 2 * 2 - (8 * 4 + 4)
    assert strip > 5  # room for the text
    for i, colour in enumerate((AGREE, DISAGREE)):
        x0, y0 = _frame_pixel(grid, i, 2, 8, 8, strip=strip)
        region = a[y0 + 36:y0 + 36 + strip, x0:x0 + 36].reshape(-1, 3)
        # The strip is the verdict's colour with light text on it (antialiased: near-white, not only white).
        assert (region == np.array(colour, np.uint8)).all(1).mean() > 0.5
        assert (region.min(1) > 200).sum() >= 10
    with pytest.raises(ValueError, match="got 2 images and 1 verdicts"):
        make_verdict_grid(images, [True])
    with pytest.raises(ValueError, match=r"agrees\[1\] = 1; a verdict is True, False or None"):
        make_verdict_grid(images, [True, 1])


def test_judged_sample_grid_uses_the_judge_that_gives_verdicts(judge):
    _, x_test, _, y_test = digit_split()
    images = torch.from_numpy(x_test[:4] / 16.0).float()[:, None]
    metadata = [{"digit": int(d)} for d in y_test[:4]]
    metadata[1] = {"digit": (int(y_test[1]) + 1) % 10}
    grid = judged_sample_grid(images, [""] * 4, metadata, {"plain": MaxPixelJudge(), "svc": judge}, nrow=4)
    expected = judge.verdicts(images, [""] * 4, metadata)
    want = make_verdict_grid(images, [v.agrees for v in expected], [v.label for v in expected], nrow=4)
    assert expected[1].agrees is False and np.array_equal(np.asarray(grid), np.asarray(want))
    # No judge gives verdicts: the plain grid, as before.
    plain = judged_sample_grid(images, [""] * 4, metadata, {"plain": MaxPixelJudge()}, nrow=4)
    assert np.array_equal(np.asarray(plain), np.asarray(make_image_grid(images, nrow=4)))
