"""The training loop of every recipe: eight numbered phases per step, over the algorithm protocol.

    run = RecipeRun(cfg, recipe="grpo")                   # accelerator, run dir, resume (flywheel/recipe/session.py)
    algorithm = GRPO(policy, optimizer, transformer, cfg, run.accelerator)   # trainers/grpo.py
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    summary = train(run, rollouts, algorithm)

The loop owns the weight version: it syncs once after an update that stepped
(flywheel/recipe/algorithm.py says what the algorithm must do). A step whose
batch carries no signal (every sample masked, or every group's rewards equal)
calls no update: an optimizer step would still move the weights through
AdamW's momentum and weight decay. Each step without an optimizer step is
said on the progress bar and counted; a run in which none took one raises
NothingTrainedError once everything is saved. Each optimizer step's size
relative to the weights is logged (train/update_rel, flywheel/recipe/weight_motion.py),
and one under MIN_RELATIVE_STEP (rounding: a loss scaled to about zero) counts
as a step that trained nothing, said and counted the same way.
The run directory's lock is let go on the way out, however the run ends.
"""

from __future__ import annotations

import sys
import time

from flywheel.distributed import all_reduce_mean
from flywheel.guards import NoSignalError
from flywheel.recipe.algorithm import Algorithm, UpdateResult, trains_on_advantages
from flywheel.recipe.weight_motion import MIN_RELATIVE_STEP, WeightMotion

# Why a step took no optimizer step, when no update was called (an update that takes none gives its own reason).
FLAT_STEP = "every group's rewards were equal (flat groups: no advantage to learn from)"
MASKED_STEP = "the rewards masked every sample"
# A step whose optimizer step changed the weights by rounding at most: its gradient is under AdamW's eps, so a
# factor in the loss is about zero (an advantage clip, a reward scale, a beta, a LoRA alpha of 1e-30).
UNMOVED_STEP = (f"its optimizer step moved the weights by under {MIN_RELATIVE_STEP:g} of their size "
                "(train/update_rel) beyond weight decay: the loss's gradient is under AdamW's eps, so a scale in it "
                "is about zero")


def train(run, rollouts, algorithm: Algorithm) -> dict:
    """Steps run.start_step..cfg.steps of `algorithm` on `rollouts`; returns the run's summary (RecipeRun.finish)."""
    try:
        return _train(run, rollouts, algorithm)
    finally:
        run.dir.release()


def _train(run, rollouts, algorithm: Algorithm) -> dict:
    cfg = run.cfg
    run.begin(rollouts)  # resume checks, judges, trackers: set-up, outside time/wall_s like model loading
    started = time.perf_counter() - run.wall_offset  # time/wall_s continues a resumed run's
    base_eval = run.base_evaluation()  # the step-0 evaluation (a fresh run's)
    version = rollouts.version
    steps = StepAccounting(run.trainer_state, cfg.reward.max_masked_steps, run.dir.metrics_path, run.is_main,
                           max_flat_steps=cfg.reward.max_flat_steps)
    motion = WeightMotion(run.policy.named_params)
    row, stopping, progress = {}, False, run.progress()
    try:
        for step in range(run.start_step, cfg.steps):
            done, step_start = step + 1, time.perf_counter()
            # 1. Roll out: this step's samples, from the weights the algorithm serves (async: prefetched).
            with run.full_params(), algorithm.serving_weights():
                batch = rollouts.collect(step, trainer_version=version)
            # 2. Score and advantages: the collector did both, over every rank; is there anything to learn?
            t0 = time.perf_counter()
            carries = batch.usable if trains_on_advantages(algorithm) else batch.rewards.valid  # DRaFT: any valid one
            signal = all_reduce_mean({"usable": float(carries.sum()), "valid": float(batch.rewards.valid.sum()),
                                      "reward": float(batch.metrics.get("reward/mean", float("nan")))})
            # 3. Update: the algorithm's optimizer steps (none when no sample carries a signal), and how far
            # they moved the weights (train/update_rel).
            if steps.has_signal(signal, step):
                before = motion.sample()
                result = algorithm.update(batch, step)
            else:
                result = steps.no_signal(signal)  # never stepped
            metrics = steps.count(result, step)
            if result.stepped:
                metrics["train/update_rel"] = motion.relative_move(before)
                # AdamW's decoupled decay alone shrinks every weight by lr·weight_decay of itself a step: motion
                # up to that much is the decay's, not the loss's (train.reward_scale=1e-30 once counted as trained).
                decay_rel = metrics["train/optimizer_steps"] * cfg.train.learning_rate * cfg.train.weight_decay
                metrics["train/skipped_steps"] = steps.count_unmoved(metrics["train/update_rel"], step, decay_rel)
            t1 = time.perf_counter()
            # 4. Sync: new weights into serving, version + 1, only when the update moved them.
            if result.stepped:
                with algorithm.serving_weights():
                    synced = rollouts.sync()
                version = synced.pop("weight_version")
                metrics.update(synced)
            metrics["weight_version_after"] = version
            # 5. EMA: the EMA average of the trained weights, on its schedule.
            metrics.update(run.move_ema(done))
            metrics.update({"time/train_s": t1 - t0, "time/wait_s": t0 - step_start})
            row = {"step": done, **all_reduce_mean({**batch.metrics, **metrics}),
                   "weight_version": batch.trajectory.weight_version, "time/step_s": time.perf_counter() - step_start}
            run.check_row(row)
            row.update(rollouts.metrics())
            # 6. Evaluate: judges, the hacking watch, best/ (main process), on eval.every and at the end.
            stopping = False
            if done % cfg.eval.every == 0 or done == cfg.steps:
                with run.full_params():
                    row.update(run.evaluate(done))
                stopping = run.stop_for_hacking()
            # 7. Log: metrics.jsonl and the trackers.
            row["time/wall_s"] = time.perf_counter() - started
            run.log(row)
            # 8. Checkpoint: weights, optimizer, RNG, the loop's state and the algorithm's tensors; a run the
            #    hacking watch stops saves too, as at its last step (its weights are not lost, it can resume).
            if done % cfg.save_every == 0 or done == cfg.steps or stopping:
                run.save(done, {"weight_version": version, "data_position": rollouts.flywheel.sampler.position(done),
                                "data_sha256": rollouts.flywheel.sampler.fingerprint(),
                                **steps.state_dict(), **rollouts.state_dict()}, algorithm.state_dict())
            run.show_progress(progress, row, version, steps.skipped)
            if stopping:
                break
    finally:
        progress.close()
        rollouts.close()
    return run.end(base_eval, row, steps.skipped, steps.reasons, stopping)


class StepAccounting:
    """The steps that took no optimizer step (and why), and the runs of all-masked or all-flat ones that stop a
    run (NoSignalError)."""

    def __init__(self, trainer_state: dict, max_masked_steps: int, metrics_path, is_main: bool,
                 max_flat_steps: int | None = None):
        self.skipped = trainer_state.get("skipped_steps", 0)  # over every session of the run
        self.masked_run = trainer_state.get("masked_run", 0)
        self.flat_run = trainer_state.get("flat_run", 0)
        self.reasons: dict[str, int] = {}  # this session's only
        self.max_masked_steps, self.metrics_path, self.is_main = max_masked_steps, metrics_path, is_main
        self.max_flat_steps = max_flat_steps

    def has_signal(self, signal: dict, step: int) -> bool:
        """Whether any sample of the step carries a signal; stops a run whose rewards mask every sample, or leave
        every group flat, too many steps in a row."""
        if signal["usable"] > 0:
            self.masked_run = self.flat_run = 0
            return True
        masked = signal["valid"] == 0
        self.masked_run = self.masked_run + 1 if masked else 0
        self.flat_run = 0 if masked else self.flat_run + 1
        if self.masked_run >= self.max_masked_steps:
            raise NoSignalError(f"step {step + 1}: the rewards masked every sample of the last {self.masked_run} "
                                f"steps (reward.max_masked_steps={self.max_masked_steps}); see the reward/*/invalid "
                                f"metrics in {self.metrics_path} and the scorer's errors")
        if self.max_flat_steps is not None and self.flat_run >= self.max_flat_steps:
            # The weights have not moved since the streak began, so the same policy would go on giving flat groups.
            raise NoSignalError(f"step {step + 1}: every group's rewards were equal in each of the last "
                                f"{self.flat_run} steps (reward.max_flat_steps={self.max_flat_steps}; reward mean "
                                f"{signal.get('reward', float('nan')):.4g}): the policy gives every sample of a "
                                f"prompt one reward (collapsed, or a bounded reward saturated), so there is nothing "
                                f"to learn from; see reward/mean and reward/zero_std_groups in {self.metrics_path}")
        return False

    @staticmethod
    def no_signal(signal: dict) -> UpdateResult:
        """The result of a step whose batch carries no signal: no update was called."""
        return UpdateResult({"train/optimizer_steps": 0.0}, False, MASKED_STEP if signal["valid"] == 0 else FLAT_STEP)

    def count(self, result: UpdateResult, step: int) -> dict:
        """The step's metrics with the run's count of skipped steps; a step without an optimizer step is said."""
        if not result.stepped:
            reason = result.skip_reason or "the update took none"
            self._skip(reason, step, f"step {step + 1} took no optimizer step: {reason}")
        return {**result.metrics, "train/skipped_steps": self.skipped}

    def count_unmoved(self, update_rel: float, step: int, decay_rel: float = 0.0) -> int:
        """Count a step whose optimizer steps moved the weights by under MIN_RELATIVE_STEP of their size beyond
        `decay_rel` (what weight decay alone moves them by) as one that trained nothing (said, with its reason);
        the run's count of such steps and skipped ones. The value is every rank's (all-reduced), so every rank
        counts alike."""
        if update_rel - decay_rel < MIN_RELATIVE_STEP:
            decay = f", of which weight decay alone {decay_rel:.2g}" if decay_rel > 0 else ""
            self._skip(UNMOVED_STEP, step, f"step {step + 1} moved no weight: train/update_rel={update_rel:.2g}"
                                            f"{decay}; {UNMOVED_STEP.split(': ', 1)[1]}")
        return self.skipped

    def _skip(self, reason: str, step: int, line: str) -> None:
        self.skipped += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.is_main:
            from tqdm.auto import tqdm

            tqdm.write(f"warning: {line}", file=sys.stderr)

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped, "masked_run": self.masked_run, "flat_run": self.flat_run}
