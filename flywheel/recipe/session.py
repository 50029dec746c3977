"""One run of a recipe: accelerator, run directory, trackers, resume, evaluation with judges, checkpoints,
metrics, progress, and the loop that drives the algorithm's update.

    run = RecipeRun(cfg, recipe="grpo")                         # accelerator, run dir, threads
    policy = build_policy(cfg, run.device, reference=...)
    optimizer = make_optimizer(policy, cfg.train)
    run.resume(policy, optimizer)                              # a no-op for a fresh run
    transformer, optimizer = run.prepare(policy, optimizer)     # DDP / FSDP wrapping
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    result = run.train(rollouts, update)                        # update(batch, step) -> metrics

With train.ema, the run keeps an EMA of the trained weights (flywheel/recipe/ema.py) that evaluation and
the saved LoRA use; rollouts and weight sync keep the trained weights.

Every recipe writes the same run directory (config.yaml, run.json, metrics.jsonl,
samples/, checkpoints/) and the same metric keys, so runs of different
algorithms compare directly (`python -m flywheel.runs compare`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flywheel.distributed import all_reduce_mean
from flywheel.grids import judged_sample_grid
from flywheel.guards import check_finite
from flywheel.hacking_watch import HackingWatch
from flywheel.lora import save_lora_for_diffusers
from flywheel.loop import RolloutBatch
from flywheel.prompts import load_prompts
from flywheel.recipe.ema import WeightEMA, train_ema_decay
from flywheel.recipe.policy import Policy, fsdp_full_params
from flywheel.recipe.rollouts import Rollouts
from flywheel.recipe.sections import eval_request_kwargs
from flywheel.runs.checkpoint import load_checkpoint, load_trainable, save_checkpoint
from flywheel.runs.config import config_to_dict, save_config
from flywheel.runs.rundir import RunDir, atomic_write_text
from flywheel.runs.tracking import log_images, log_videos, prepare_tracker, tracker_names
from flywheel.video import is_video, middle_frame, write_mp4, write_wav
from rewards.judges import judges_for_card
from rewards.registry import get as get_scorer

RUN_INFO_FILENAME = "run.json"
# Checkpointed tensors of a recipe's own (a sampling policy, an EMA) travel beside the trained weights
# under this prefix, and are handed back to the recipe on resume.
RECIPE_TENSOR_PREFIX = "recipe/"
# train.ema's average of the trained weights in a checkpoint (its own prefix: a recipe's tensors stay its own).
EMA_TENSOR_PREFIX = "ema/"

Update = Callable[[RolloutBatch, int], dict]


class RecipeRun:
    """The run-level machinery of a recipe; the algorithm comes in as `update(batch, step) -> metrics`."""

    def __init__(self, cfg, recipe: str):
        from accelerate import Accelerator

        self.cfg, self.recipe = cfg, recipe
        self._tracker_kwargs = prepare_tracker(cfg.tracker, Path(cfg.run_dir))
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                       log_with=tracker_names(cfg.tracker) or None,
                                       project_dir=cfg.run_dir)
        # A run dir belongs to one run: a fresh run refuses a used one unless told to overwrite it.
        self.dir = RunDir(cfg.run_dir, mode="resume" if cfg.resume else "overwrite" if cfg.overwrite else "new",
                          tracker_dirs=(cfg.project, "mlruns"), is_main_process=self.is_main)
        self.accelerator.wait_for_everyone()
        if self.accelerator.device.type == "cpu":
            # One thread per rank: ranks sharing the cores must not oversubscribe them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.accelerator.num_processes))
        self.start_step, self.version, self.trainer_state = 0, 0, {}
        self.recipe_tensors: dict[str, torch.Tensor] = {}
        self.ema: WeightEMA | None = None  # train.ema's average, held by the main process (it evaluates and saves)
        self.wall_offset = 0.0  # wall seconds of the run before a resume
        self.full_params = None

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # --- setup ------------------------------------------------------------------------------------

    def resume(self, policy: Policy, optimizer) -> None:
        """Load the checkpoint named by resume= (weights, optimizer, RNG, trainer state, train.ema's average);
        for a fresh run, save its config and start train.ema's average at the weights as they are.

        The recipe's own checkpointed tensors (see `save`) land in `self.recipe_tensors`.
        """
        cfg = self.cfg
        if not cfg.resume:
            if self.is_main:
                save_config(cfg, self.dir.path / "config.yaml")
                atomic_write_text(self.dir.path / RUN_INFO_FILENAME,
                                  json.dumps({"recipe": self.recipe, "card": cfg.model.card}) + "\n")
            self.ema = self._start_ema(policy, None)
            return
        # resolve_resume verified its checksums a moment ago; load checks names, sizes and finiteness.
        state, trainer_state = load_checkpoint(cfg.resume, optimizer=optimizer, named_params=policy.named_params,
                                               checksums=False)
        self.recipe_tensors = _with_prefix(state, RECIPE_TENSOR_PREFIX)
        ema_state = _with_prefix(state, EMA_TENSOR_PREFIX)
        trained = {k: v for k, v in state.items() if not k.startswith((RECIPE_TENSOR_PREFIX, EMA_TENSOR_PREFIX))}
        load_trainable(policy.named_params, trained, cfg.resume)  # strict: every trained tensor, nothing else
        self.ema = self._start_ema(policy, ema_state)
        self.start_step, self.version = trainer_state["step"], trainer_state["weight_version"]
        self.trainer_state = trainer_state
        if self.is_main:
            self.dir.metrics.truncate_after(self.start_step)  # rows a killed run wrote after its last checkpoint
            # time/wall_s continues from the checkpoint's step, so curves against wall time join up.
            walls = [r["time/wall_s"] for r in self.dir.metrics.read() if "time/wall_s" in r]
            self.wall_offset = walls[-1] if walls else 0.0

    def _start_ema(self, policy: Policy, checkpointed: dict[str, torch.Tensor] | None) -> WeightEMA | None:
        """train.ema's average on the main process: the weights of a fresh run, the checkpoint's on resume."""
        if not self.cfg.train.ema:
            if checkpointed and self.is_main:  # allowed (evaluation on the trained weights), but never silently
                print(f"warning: resume={self.cfg.resume} holds a train.ema average and this run has train.ema="
                      "false: the average is dropped, and the next checkpoints will not hold it (resume with "
                      "train.ema=true to keep it)", file=sys.stderr, flush=True)
            return None
        if checkpointed is not None and not checkpointed:  # checked on every rank: they all stop together
            raise ValueError(f"resume={self.cfg.resume}: the checkpoint holds no train.ema average (its run had "
                             "train.ema=false); resume with train.ema=false, or start a fresh run")
        if not self.is_main:
            return None
        ema = WeightEMA(policy.named_params, what="the train.ema average")
        if checkpointed:
            ema.load_state_dict(checkpointed)
        return ema

    def prepare(self, policy: Policy, optimizer):
        """Wrap the transformer and optimizer for the launch (DDP, FSDP); returns (train_transformer, optimizer)."""
        train_transformer, optimizer = self.accelerator.prepare(policy.transformer, optimizer)
        # FSDP shards model.transformer's parameters in place; the engine's rollouts (and checkpoints)
        # need them whole: gather them for the duration, on every rank (the gather is a collective).
        self.full_params = fsdp_full_params(self.accelerator, train_transformer)
        self.policy, self.optimizer = policy, optimizer
        return train_transformer, optimizer

    # --- the loop ---------------------------------------------------------------------------------

    def train(self, rollouts: Rollouts, update: Update, recipe_state: Callable[[], dict] | None = None) -> dict:
        """Roll out, update, evaluate, log and checkpoint for steps start..cfg.steps; returns the run's summary.

        `update(batch, step)` runs the algorithm's optimizer steps and returns its
        metrics, including "weight_version_after". A step with no usable sample
        (all masked, or every group's rewards equal) takes no optimizer step.
        `recipe_state()` gives the recipe's own tensors to checkpoint (see `resume`).
        """
        cfg, accelerator = self.cfg, self.accelerator
        if rollouts.flywheel.sampler.position(self.start_step) != self.trainer_state.get(
                "data_position", rollouts.flywheel.sampler.position(self.start_step)):
            raise ValueError(f"resume={cfg.resume}: the checkpoint was at data position "
                             f"{self.trainer_state['data_position']} but step {self.start_step} of these prompts is "
                             f"at {rollouts.flywheel.sampler.position(self.start_step)}: data.prompts or "
                             "data.prompts_per_step changed since it was saved")
        self.rollouts = rollouts
        self.judges = {**judges_for_card(cfg.model.card), **eval_judges(cfg.eval_judges)} if self.is_main else {}
        self.watch = HackingWatch()  # reward rising while the judge falls, overall or in one class
        for earlier in (self.dir.metrics.read() if cfg.resume and self.is_main else []):
            if "eval/reward/mean" in earlier:  # a resumed run keeps comparing with the evaluations before it
                self.watch.update(earlier, earlier["step"])
        if tracker_names(cfg.tracker):
            accelerator.init_trackers(cfg.project, config=_flatten(config_to_dict(cfg)),
                                      init_kwargs=self._tracker_kwargs)
        started = time.perf_counter() - self.wall_offset

        base_eval = None
        if self.start_step == 0:
            with self.full_params():
                base_eval = self.evaluate(0)
            self.log({"step": 0, "weight_version": rollouts.version, "time/wall_s": 0.0, **base_eval})
        progress = _progress(self.recipe, self.is_main, self.start_step, cfg.steps)
        row: dict = {}
        version = rollouts.version
        skipped = self.trainer_state.get("skipped_steps", 0)
        masked_run = self.trainer_state.get("masked_run", 0)
        try:
            for step in range(self.start_step, cfg.steps):
                step_start = time.perf_counter()
                with self.full_params():
                    batch = rollouts.collect(step, trainer_version=version)
                t0 = time.perf_counter()
                signal = all_reduce_mean({"usable": float(batch.usable.sum()),
                                          "valid": float(batch.rewards.valid.sum())})
                if signal["usable"] > 0:
                    masked_run = 0
                    train_metrics = update(batch, step)
                else:
                    # No sample carries a signal (all masked, or every group's rewards equal): an optimizer
                    # step would still move the weights through AdamW's momentum and weight decay. Skip it.
                    skipped += 1
                    masked_run = masked_run + 1 if signal["valid"] == 0 else 0
                    if masked_run >= cfg.train.max_masked_steps:
                        raise RuntimeError(
                            f"step {step + 1}: the rewards masked every sample of the last {masked_run} steps "
                            f"(train.max_masked_steps={cfg.train.max_masked_steps}); see the reward/*/invalid "
                            f"metrics in {self.dir.metrics_path} and the scorer's errors")
                    train_metrics = {"weight_version_after": version}
                train_metrics["train/skipped_steps"] = skipped
                train_metrics.update(self.move_ema(step + 1))
                train_metrics["time/train_s"] = time.perf_counter() - t0 - train_metrics.get("sync/total_s", 0.0)
                train_metrics["time/wait_s"] = t0 - step_start
                version = train_metrics["weight_version_after"]
                row = {"step": step + 1, **all_reduce_mean({**batch.metrics, **train_metrics})}
                row["weight_version"] = batch.trajectory.weight_version
                row["time/step_s"] = time.perf_counter() - step_start
                for key in ("loss", "kl"):
                    if key in row:
                        check_finite(row[key], f"the mean {key}", step + 1)
                row.update(rollouts.metrics())
                done = step + 1
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    with self.full_params():
                        row.update(self.evaluate(done))
                row["time/wall_s"] = time.perf_counter() - started
                self.log(row)
                if done % cfg.save_every == 0 or done == cfg.steps:
                    self.save(done, {"weight_version": version, "data_position": rollouts.flywheel.sampler.position(done),
                                     "skipped_steps": skipped, "masked_run": masked_run, **rollouts.state_dict()},
                              recipe_state() if recipe_state is not None else {})
                progress.update(1)
                progress.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}",
                                     kl=f"{row.get('kl', 0.0):.2e}", v=version,
                                     **({"HACKING?": self.watch.last.short} if self.watch.last.short else {}))
        finally:
            progress.close()
            rollouts.close()
        return self.finish(base_eval, row)

    # --- the blocks the loop uses -------------------------------------------------------------------

    def move_ema(self, steps_done: int) -> dict:
        """After a training step: move train.ema's average on its schedule (`train_ema_decay`); its metrics.

        Once per training step rather than per optimizer step: the unit of every step key, and a state that
        every checkpoint ends on. A step that took no optimizer step still counts (the weights stayed).
        """
        if not self.cfg.train.ema:
            return {}
        decay = train_ema_decay(steps_done, self.cfg.train)
        if decay is None:
            return {}
        with self.full_params():  # a collective under FSDP: every rank enters, the main process averages
            if self.ema is not None:
                self.ema.update(self.policy.named_params, decay)
        return {"ema/decay": decay}

    def ema_weights(self):
        """A context in which the trained module holds train.ema's average (a no-op without train.ema)."""
        if self.ema is None:
            return contextlib.nullcontext()
        return self.policy.weights_swapped(self.ema.shadow)

    def evaluate(self, step: int) -> dict:
        """Evaluate on the main process (judges, per-class metrics, the hacking watch); save and log a sample grid."""
        if not self.is_main:
            return {}
        cfg = self.cfg
        items = load_prompts(cfg.data.eval_prompts)
        # With train.ema the evaluation engine's module runs the average for these samples only: the weights are
        # back, bit for bit, before the next rollout, and the engine's version (which names the trained
        # weights, and which no swap bumps) is left alone. eval/ema says which weights were measured.
        with self.ema_weights():
            metrics, traj = self.rollouts.evaluate(items, cfg.sampling.eval_seeds,
                                                   eval_request_kwargs(cfg.sampling), self.judges)
        if self.ema is not None:
            metrics["eval/ema"] = 1.0
        watched = self.watch.update(metrics, step)
        metrics.update(watched.metrics)
        if watched.new:  # printed once when it starts; the progress bar shows it while it lasts
            _progress_write(f"step {step}: {watched.warning}")
        if step % cfg.sample_every == 0 or step == cfg.steps:
            # One image per prompt, first seed: a row per class for the toy tasks, framed by the judge's verdict.
            first = slice(None, None, cfg.sampling.eval_seeds)
            shown = traj.images[first].detach().cpu()
            if is_video(shown):
                # With the sound of a joint audio+video card muxed in, at the card's frame rate.
                audio = traj.audio[first].detach().cpu() if getattr(traj, "audio", None) is not None else None
                fps = self.policy.card_defaults.get("fps", 16)
                paths = [write_mp4(v, self.dir.samples_dir / f"step-{step:06d}-{i:02d}.mp4", fps=fps,
                                   audio=None if audio is None else audio[i],
                                   sample_rate=None if audio is None else traj.audio_sample_rate)
                         for i, v in enumerate(shown[:8])]
                for i, sound in enumerate([] if audio is None else audio[:8]):  # the sound alone, lossless
                    write_wav(sound, traj.audio_sample_rate, self.dir.samples_dir / f"step-{step:06d}-{i:02d}.wav")
                log_videos(self.accelerator, "eval/videos", paths, step)
                shown = middle_frame(shown)
            grid = judged_sample_grid(shown, traj.prompts[first], traj.metadata[first], self.judges,
                                      nrow=len(items) // 10 or None)
            grid.save(self.dir.sample_path(step))
            log_images(self.accelerator, "eval/samples", [grid], step)
        return metrics

    def log(self, row: dict) -> None:
        if self.is_main:
            self.dir.metrics.append(row)
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def save(self, step: int, trainer_state: dict, recipe_tensors: dict[str, torch.Tensor]) -> None:
        """Checkpoint the trained weights, the optimizer, RNG and trainer state (and the recipe's tensors, and
        train.ema's average: the trained weights stay the ones a resume continues from)."""
        with self.full_params():
            if self.is_main:
                tensors = {n: p.detach() for n, p in self.policy.named_params}
                tensors.update({RECIPE_TENSOR_PREFIX + k: v.detach() for k, v in recipe_tensors.items()})
                if self.ema is not None:
                    tensors.update({EMA_TENSOR_PREFIX + k: v for k, v in self.ema.state_dict().items()})
                raw_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
                save_checkpoint(self.dir.checkpoints_dir, step, tensors, raw_optimizer, self.policy.named_params,
                                {"step": step, **trainer_state}, keep_last=self.cfg.keep_checkpoints)
        self.accelerator.wait_for_everyone()

    def finish(self, base_eval: dict | None, row: dict) -> dict:
        """Save the LoRA for diffusers (train.ema's average when on, as Flow-GRPO saves), print base -> final,
        end the trackers; a NaN final eval fails the run."""
        cfg = self.cfg
        if cfg.model.finetune == "lora" and self.policy.card_defaults.get("diffusers_pipeline"):
            # The adapter in the format a stock pipeline's load_lora_weights(run_dir / "lora") reads.
            with self.full_params():
                if self.is_main:
                    with self.ema_weights():
                        save_lora_for_diffusers(self.policy.transformer, self.dir.path / "lora",
                                                self.policy.card_defaults["diffusers_pipeline"])
            self.accelerator.wait_for_everyone()
        final_eval = {k: v for k, v in row.items() if k.startswith("eval/")}
        if self.is_main:
            base = base_eval if base_eval is not None else self._first_eval()
            print(f"eval reward: base {base.get('eval/reward/mean', float('nan')):.3f} -> "
                  f"final {final_eval.get('eval/reward/mean', float('nan')):.3f} (run dir {self.dir.path})", flush=True)
        self.accelerator.end_training()
        if self.is_main and "eval/reward/mean" in final_eval:
            # Everything is saved; a NaN final evaluation still makes the run fail rather than exit 0.
            check_finite(final_eval["eval/reward/mean"], "the final evaluation reward", cfg.steps,
                         "every evaluation sample was masked: see the eval/reward/*/invalid metrics")
        return {"base": base_eval, "final": final_eval, "run_dir": str(self.dir.path)}

    def _first_eval(self) -> dict:
        rows = [r for r in self.dir.metrics.read() if r.get("step") == 0]
        return rows[0] if rows else {}


def _with_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of `state` whose names start with `prefix`, the prefix taken off."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def _progress_write(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def _progress(name: str, enabled: bool, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc=name, disable=not enabled, dynamic_ncols=True)


def eval_judges(names: str) -> dict:
    """The scorers named in `eval_judges` (comma-separated), built to evaluate only, by name."""
    return {name: get_scorer(name) for name in (n.strip() for n in names.split(",")) if name}
