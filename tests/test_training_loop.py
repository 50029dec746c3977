"""The training loop over the algorithm protocol, the rollout layouts' table and factory, and the renamed modules."""

import contextlib
import importlib
import math
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from flywheel.recipe import rollouts as layouts
from flywheel.recipe import training_loop
from flywheel.recipe.algorithm import Algorithm, UpdateResult, gradient_result
from flywheel.config.parsing import ConfigError
from flywheel.recipe.training_loop import FLAT_STEP, train
from flywheel.recipe.weight_motion import WeightMotion, check_step_size

# ---- the loop: it owns the weight version and syncs once after an update that stepped ---------------------


class FakeRollouts:
    def __init__(self, usable):
        self.usable, self.version, self.events, self.closed = usable, 0, [], False
        self.flywheel = SimpleNamespace(sampler=SimpleNamespace(position=lambda step: step, fingerprint=lambda: "0" * 64))

    def collect(self, step, trainer_version):
        self.events.append(("collect", step, trainer_version))
        n = self.usable[step]
        return SimpleNamespace(usable=torch.ones(n), rewards=SimpleNamespace(valid=torch.ones(4)), metrics={},
                               trajectory=SimpleNamespace(weight_version=self.version))

    def sync(self):
        self.version += 1
        self.events.append(("sync", self.version))
        return {"weight_version": self.version, "sync/bytes": 8.0}

    def metrics(self):
        return {}

    def state_dict(self):
        return {}

    def close(self):
        self.closed = True


# The fake runs' one trained weight (the loop measures how far each optimizer step moved it).
WEIGHT = torch.nn.Parameter(torch.ones(4))


class FakeAlgorithm:
    """Steps on the steps named in `steps_on`, moving WEIGHT by `move`; records what the loop did around it."""

    def __init__(self, rollouts, steps_on, move=0.1):
        self.rollouts, self.steps_on, self.serving, self.move = rollouts, steps_on, False, move

    def update(self, batch, step):
        self.rollouts.events.append(("update", step))
        n = 1.0 if step in self.steps_on else 0.0
        with torch.no_grad():
            WEIGHT.add_(self.move * n)
        return gradient_result({"loss": 0.5, "train/optimizer_steps": n}, skip_reason="no pair")

    @contextlib.contextmanager
    def serving_weights(self):
        self.serving = True
        self.rollouts.events.append(("serving",))
        try:
            yield
        finally:
            self.serving = False

    def state_dict(self):
        return {"theta_old": torch.zeros(1)}

    def load_state_dict(self, state):
        pass


class FakeRun:
    def __init__(self, steps):
        self.cfg = SimpleNamespace(steps=steps, eval=SimpleNamespace(every=100), save_every=2,
                                   reward=SimpleNamespace(max_masked_steps=5, max_flat_steps=10),
                                   train=SimpleNamespace(learning_rate=1e-3, weight_decay=0.0))
        self.policy = SimpleNamespace(named_params=[("w", WEIGHT)])
        self.trainer_state, self.start_step, self.wall_offset, self.is_main = {}, 0, 0.0, False
        self.dir = SimpleNamespace(metrics_path="metrics.jsonl", release=lambda: setattr(self, "released", True))
        self.rows, self.saved, self.released = [], [], False

    def begin(self, rollouts):
        pass

    def base_evaluation(self):
        return {}

    def progress(self):
        return SimpleNamespace(close=lambda: None)

    def full_params(self):
        return contextlib.nullcontext()

    def move_ema(self, done):
        return {}

    def check_row(self, row):
        pass

    def evaluate(self, step):
        return {"eval/reward/mean": 1.0}

    def stop_for_hacking(self):
        return False

    def log(self, row):
        self.rows.append(row)

    def save(self, step, state, tensors):
        self.saved.append((step, state, sorted(tensors)))

    def show_progress(self, *args):
        pass

    def end(self, base_eval, row, skipped, reasons, stopping):
        return {"skipped": skipped, "reasons": reasons}


def test_the_loop_syncs_once_after_an_update_that_stepped_inside_the_served_weights():
    rollouts = FakeRollouts(usable=[4, 4, 0, 4])  # step 2 has no usable sample: no update is called
    algorithm = FakeAlgorithm(rollouts, steps_on={0, 3})  # step 1's update takes no optimizer step
    run = FakeRun(steps=4)
    assert isinstance(algorithm, Algorithm)
    summary = train(run, rollouts, algorithm)
    updates = [e[1] for e in rollouts.events if e[0] == "update"]
    syncs = [e for e in rollouts.events if e[0] == "sync"]
    assert updates == [0, 1, 3] and syncs == [("sync", 1), ("sync", 2)]  # one sync per update that stepped
    # Every rollout and every sync ran inside serving_weights() (the event before it).
    for i, event in enumerate(rollouts.events):
        if event[0] in ("collect", "sync"):
            assert rollouts.events[i - 1] == ("serving",), event
    assert [e[2] for e in rollouts.events if e[0] == "collect"] == [0, 1, 1, 1]  # the loop's version, passed on
    assert [r["weight_version_after"] for r in run.rows] == [1, 1, 1, 2]
    assert [r["train/skipped_steps"] for r in run.rows] == [0, 1, 2, 2]
    assert "sync/bytes" in run.rows[0] and "sync/bytes" not in run.rows[1]
    assert summary == {"skipped": 2, "reasons": {"no pair": 1, FLAT_STEP: 1}}
    assert [(s, st["weight_version"], t) for s, st, t in run.saved] == [(2, 1, ["theta_old"]), (4, 2, ["theta_old"])]
    assert rollouts.closed and run.released


def test_a_run_of_masked_steps_stops_the_loop_and_releases_the_run_dir():
    rollouts = FakeRollouts(usable=[0, 0, 0])
    original = rollouts.collect

    def masked(step, trainer_version):
        batch = original(step, trainer_version)
        batch.rewards.valid = torch.zeros(4)
        return batch

    rollouts.collect = masked
    run = FakeRun(steps=3)
    run.cfg.reward.max_masked_steps = 2
    with pytest.raises(RuntimeError, match=r"step 2: the rewards masked every sample of the last 2 steps"):
        train(run, rollouts, FakeAlgorithm(rollouts, steps_on=set()))
    assert run.released and rollouts.closed
    assert [(r['step'], r['train/skipped_steps']) for r in run.rows] == [(1, 1)]  # step 1 logged, step 2 stopped


def test_a_run_of_flat_steps_stops_the_loop_and_a_usable_or_masked_step_breaks_the_run():
    # usable counts per step: 0 is a flat step (valid rewards, none usable); step 4 is masked (no valid reward).
    rollouts = FakeRollouts(usable=[0, 0, 4, 0, 0, 0, 0, 0, 0])
    original = rollouts.collect

    def some_masked(step, trainer_version):
        batch = original(step, trainer_version)
        batch.metrics = {"reward/mean": 0.25}
        if step == 4:
            batch.rewards.valid = torch.zeros(4)
        return batch

    rollouts.collect = some_masked
    run = FakeRun(steps=9)
    run.cfg.reward.max_flat_steps = 3
    # Flat at 1-2 (broken by the usable step 3), flat at 4, masked at 5 (breaks it too), flat at 6, 7, 8: stop.
    with pytest.raises(training_loop.NoSignalError,
                       match=r"^step 8: every group's rewards were equal in each of the last 3 steps "
                             r"\(reward.max_flat_steps=3; reward mean 0.25\)"):
        train(run, rollouts, FakeAlgorithm(rollouts, steps_on={2}))
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4, 5, 6, 7]
    assert run.released and rollouts.closed
    # The streak is checkpointed: a resume continues it (step 6's checkpoint holds the flat step 6).
    saved = {step: state for step, state, _ in run.saved}
    assert (saved[2]["flat_run"], saved[4]["flat_run"], saved[6]["flat_run"]) == (2, 1, 1)
    assert saved[6]["masked_run"] == 0 and saved[4]["masked_run"] == 0


def test_a_resumed_flat_streak_continues_from_the_checkpoint():
    accounting = training_loop.StepAccounting({"flat_run": 2}, max_masked_steps=3, metrics_path="m.jsonl",
                                              is_main=False, max_flat_steps=3)
    with pytest.raises(training_loop.NoSignalError, match=r"^step 5: .* last 3 steps"):
        accounting.has_signal({"usable": 0.0, "valid": 4.0, "reward": 1.0}, step=4)
    fresh = training_loop.StepAccounting({}, max_masked_steps=3, metrics_path="m.jsonl", is_main=False,
                                         max_flat_steps=3)
    assert not fresh.has_signal({"usable": 0.0, "valid": 4.0, "reward": 1.0}, step=4)
    assert fresh.state_dict()["flat_run"] == 1


def test_the_loop_logs_each_optimizer_steps_size_relative_to_the_weights():
    """train/update_rel on every step that took an optimizer step (none on a flat one), measured, not assumed: a
    step that moved nothing but rounding logs 0 and the run goes on (a step can rightly move a tensor by
    nothing: a Wan2.2 expert that no sample's timestep reached)."""
    rollouts = FakeRollouts(usable=[0, 4, 4, 4])
    run = FakeRun(steps=4)
    with torch.no_grad():
        WEIGHT.fill_(2.0)
    train(run, rollouts, FakeAlgorithm(rollouts, steps_on={1, 3}, move=0.2))  # 10% of the weights' RMS
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4]
    assert [r.get("train/update_rel") for r in run.rows[:2]] == [None, pytest.approx(0.1, rel=1e-6)]
    assert "train/update_rel" not in run.rows[2] and run.rows[3]["train/update_rel"] == pytest.approx(0.2 / 2.2)
    rollouts, run = FakeRollouts(usable=[4, 4]), FakeRun(steps=2)
    train(run, rollouts, FakeAlgorithm(rollouts, steps_on={0, 1}, move=1e-12))  # under float32's ulp of 2.4
    assert [r["train/update_rel"] for r in run.rows] == [0.0, 0.0]


def test_a_learning_rate_under_rounding_of_the_weights_is_refused():
    weights = [("a", torch.nn.Parameter(torch.full((4,), 0.02))), ("lora_B", torch.nn.Parameter(torch.zeros(4)))]
    rms = 0.02 / 2 ** 0.5  # the zeros count
    no_clip = math.inf
    check_step_size(1e-4, no_clip, weights)
    check_step_size(1.01e-7 * rms, no_clip, weights)  # just over the bound
    with pytest.raises(ConfigError, match=r"^train.learning_rate=1e-12: .* the trained weights' RMS is 0.0141, so "
                       r"every step would change them by under 1e-07 of their size .* at least 1e-09"):
        check_step_size(1e-12, no_clip, weights)
    with pytest.raises(ConfigError):
        check_step_size(0.99e-7 * rms, no_clip, weights)
    check_step_size(1e-12, no_clip, [("b", torch.nn.Parameter(torch.zeros(3)))])  # all zero: nothing to compare with


def test_a_max_grad_norm_that_holds_the_gradient_under_adams_eps_is_refused():
    # 10^6 weights of 0.02 at lr 1e-4: a clipped gradient of norm c has an RMS of c/1000 per weight, and AdamW's
    # step is about lr·min(1, (c/1000)/1e-8); it must reach 1e-7·0.02, so c >= 2e-5·1e-5 = 2e-10 (rounded: 2e-10).
    weights = [("w", torch.nn.Parameter(torch.full((10**6,), 0.02)))]
    check_step_size(1e-4, 1.0, weights)  # the shipped clip: its factor is 1
    check_step_size(1e-4, 2.02e-10, weights)  # just over
    with pytest.raises(ConfigError, match=r"^train.max_grad_norm=1e-12: clipping holds the gradient of the 1000000 "
                       r"trained weights to an RMS of 1e-15 per weight, under AdamW's eps \(1e-08\), so each step "
                       r"moves a weight by about 1e-11, .* at least 2e-10 \(the shipped configs use 1.0\)$"):
        check_step_size(1e-4, 1e-12, weights)
    with pytest.raises(ConfigError, match=r"^train.max_grad_norm="):
        check_step_size(1e-4, 1.98e-10, weights)
    with pytest.raises(ConfigError, match=r"^train.learning_rate=1e-12: "):  # the rate alone is too small: it is named
        check_step_size(1e-12, 1e-12, weights)


def test_a_learning_rate_that_rounds_away_on_most_bfloat16_weights_is_refused():
    # bfloat16 has 8 bits of precision: 1.0 + s changes only for s over half its last bit, 2^-8 (0.0039).
    ones = [("w", torch.nn.Parameter(torch.ones(100, dtype=torch.bfloat16)))]
    check_step_size(2 ** -8 * 1.01, 1.0, ones)
    with pytest.raises(ConfigError, match=r"^train.learning_rate=0.00386719 on bfloat16 trained weights: .* a step of "
                       r"about 0.0039 changes 0% of them, so most of each update would round away; train float32"):
        check_step_size(2 ** -8 * 0.99, 1.0, ones)
    check_step_size(2 ** -8 * 0.99, 1.0, [("w", torch.nn.Parameter(torch.ones(100)))])  # float32: far over its bit
    # Half the weights small enough to move, half not: the bound is "at least half change"; zeros are left out.
    mixed = torch.cat([torch.full((50,), 2.0 ** -6), torch.ones(50), torch.zeros(100)]).to(torch.bfloat16)
    check_step_size(2 ** -13, 1.0, [("w", torch.nn.Parameter(mixed))])  # 2^-13 moves 2^-6 (half bit 2^-14)
    with pytest.raises(ConfigError, match=r"changes 49% of them"):
        small = torch.cat([torch.full((49,), 2.0 ** -6), torch.ones(51)]).to(torch.bfloat16)
        check_step_size(2 ** -13, 1.0, [("w", torch.nn.Parameter(small))])


def test_update_rel_is_the_rms_of_the_update_over_the_rms_of_the_weights():
    weights = [torch.nn.Parameter(torch.tensor([3.0, 4.0])), torch.nn.Parameter(torch.zeros(1000))]
    motion = WeightMotion([("a", weights[0]), ("b", weights[1])], per_tensor=256)
    assert [i.tolist()[:3] + [len(i)] for i in motion.index] == [[0, 1, 2], [0, 4, 8, 256]]  # evenly spaced
    before = motion.sample()
    with torch.no_grad():
        weights[0].add_(torch.tensor([0.3, 0.4]))  # 10% of the sampled weights' norm (5)
        weights[1][1] = 7.0  # not a sampled element: unseen
    assert motion.relative_move(before) == pytest.approx(0.1, rel=1e-6)  # float32 weights
    assert motion.relative_move(motion.sample()) == 0.0
    zero = WeightMotion([("b", torch.nn.Parameter(torch.zeros(3)))])
    assert zero.relative_move(zero.sample()) == 0.0


def test_an_update_result_says_the_same_as_its_optimizer_step_count():
    assert UpdateResult({"train/optimizer_steps": 2.0}, True).stepped
    with pytest.raises(ValueError, match="train/optimizer_steps"):
        UpdateResult({"loss": 1.0}, True)
    with pytest.raises(ValueError, match="disagrees"):
        UpdateResult({"train/optimizer_steps": 0.0}, True)
    assert gradient_result({"train/optimizer_steps": 0.0}, "why").skip_reason == "why"
    assert gradient_result({"train/optimizer_steps": 1.0}, "why").skip_reason is None


def test_every_recipe_is_an_algorithm():
    from trainers.awm import AWM
    from trainers.dpo import DPO
    from trainers.grpo import GRPO
    from trainers.nft import NFT

    for cls in (GRPO, NFT, AWM, DPO):
        assert all(callable(getattr(cls, name)) for name in ("update", "serving_weights", "state_dict",
                                                              "load_state_dict")), cls


# ---- layouts: one table of what combines, one factory ------------------------------------------------------


def layout_cfg(asynchronous=False, backend="local", workflow=None, flash=None, ema=False):
    return SimpleNamespace(rollout=SimpleNamespace(backend=backend, asynchronous=asynchronous),
                           workflow=SimpleNamespace(name=workflow), train=SimpleNamespace(flash_compress=flash),
                           ema=SimpleNamespace(enabled=ema))


ON = {"rollout.asynchronous=true": {"asynchronous": True}, "rollout.backend=ray": {"backend": "ray"},
      "workflow.name": {"workflow": "toy.digits_then_refine"}, "train.flash_compress": {"flash": 0.5}}


@pytest.mark.parametrize("first, second, why", layouts.INCOMPATIBLE, ids=lambda x: str(x)[:24])
def test_each_pair_of_the_table_is_refused_by_the_check_and_the_factory(first, second, why):
    keys, serve = {}, "colocated"
    for option in (first, second):
        if option == "serve=swapped":
            serve = "swapped"
        else:
            keys.update(ON[option])
    cfg = layout_cfg(**keys)
    refusals = layouts.layout_refusals(cfg, serve)
    assert refusals == [f"{first} with {second}: {why}"], refusals
    with pytest.raises(ValueError, match="with"):
        layouts.make_layout(cfg, serve)
    failed = []
    layouts.check_layout_options(cfg, SimpleNamespace(fail=failed.append), serve)
    assert len(failed) == 1 and why in failed[0]


def test_the_factory_picks_one_layout_class_per_config():
    assert isinstance(layouts.make_layout(layout_cfg()), layouts.Colocated)
    assert isinstance(layouts.make_layout(layout_cfg(), serve="swapped"), layouts.SwappedIn)
    assert isinstance(layouts.make_layout(layout_cfg(asynchronous=True)), layouts.EngineProcess)
    assert isinstance(layouts.make_layout(layout_cfg(backend="ray")), layouts.RayPool)
    assert isinstance(layouts.make_layout(layout_cfg(workflow="toy.digits_then_refine")), layouts.Colocated)
    assert layouts.layout_refusals(layout_cfg(flash=0.4)) == []  # Flash alone, and colocated, combine
    with pytest.raises(ValueError, match="serve='ray': valid layouts are colocated, swapped"):
        layouts.make_layout(layout_cfg(), serve="ray")
    # Evaluation samples the trained weights: swapped-in rollouts never sample them, the processes not the EMA average.
    # (Asked of the factory's instances, as Rollouts asks.)
    assert layouts.make_layout(layout_cfg(ema=True)).evaluates_served(layout_cfg(ema=True))
    assert not layouts.make_layout(layout_cfg(), serve="swapped").evaluates_served(layout_cfg())
    assert layouts.make_layout(layout_cfg(asynchronous=True)).evaluates_served(layout_cfg())
    assert not layouts.make_layout(layout_cfg(asynchronous=True)).evaluates_served(layout_cfg(ema=True))
    for ema in (False, True):
        assert layouts.make_layout(layout_cfg(backend="ray")).evaluates_served(layout_cfg(ema=ema)) == (not ema)


# ---- renamed modules stay importable for one release --------------------------------------------------------


@pytest.mark.parametrize("old, new, name, new_name", [("flywheel.loop", "flywheel.rollout_collector", "evaluate",
                                                       "eval_samples"),
                                                      ("engine.loop", "engine.denoise", "denoise", "denoise")])
def test_the_old_module_names_warn_and_give_the_new_ones(old, new, name, new_name):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    assert getattr(module, name) is getattr(importlib.import_module(new), new_name)


def test_wall_time_counts_from_the_base_evaluation_not_the_set_up(monkeypatch):
    """time/wall_s (what time_to_target compares) leaves out set-up such as fitting the judges, as it leaves out
    model loading, and counts the base evaluation; a resumed run's continues from its offset."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(training_loop.time, "perf_counter", lambda: clock.now)

    class TimedRun(FakeRun):
        def begin(self, rollouts):
            clock.now += 100.0  # judges, trackers

        def base_evaluation(self):
            clock.now += 1.0
            return {}

    run, rollouts = TimedRun(steps=2), FakeRollouts(usable=[4, 4])
    train(run, rollouts, FakeAlgorithm(rollouts, steps_on={0, 1}))
    assert [r["time/wall_s"] for r in run.rows] == [1.0, 1.0]
    run = TimedRun(steps=1)
    run.wall_offset, rollouts = 7.0, FakeRollouts(usable=[4])
    train(run, rollouts, FakeAlgorithm(rollouts, steps_on={0}))
    assert [r["time/wall_s"] for r in run.rows] == [8.0]

