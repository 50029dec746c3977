"""One run of a recipe: accelerator, run directory, trackers, resume, evaluation with judges, checkpoints,
metrics, progress and the finish lines: the blocks the training loop (flywheel/recipe/training_loop.py) uses.

    run = RecipeRun(cfg, recipe="grpo")                         # accelerator, threads
    policy = build_policy(cfg, run.device, reference=...)       # the model's own checks: still nothing written
    optimizer = make_optimizer(policy, cfg.train)
    run.resume(policy, optimizer)                              # the run dir; config.yaml or the checkpoint
    transformer, optimizer = run.prepare(policy, optimizer)     # DDP / FSDP wrapping
    algorithm = GRPO(policy, optimizer, transformer, cfg, run.accelerator)  # flywheel/recipe/algorithm.py
    algorithm.load_state_dict(run.recipe_tensors)               # the recipe's own tensors, on resume
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    summary = train(run, rollouts, algorithm)                   # flywheel.recipe.training_loop.train

With ema.enabled, the run keeps an EMA of the trained weights (flywheel/recipe/ema.py) that evaluation uses and
that is exported beside the trained LoRA (lora_ema/ and lora/); rollouts and weight sync keep the trained weights.

The main process holds the run directory's lock (`RunDirLock`) from `RecipeRun(...)` to the end of the loop.
A step that takes no optimizer step, or one that only rounds the weights, says so on the progress bar; a run
with such steps ends with the line "N of M steps moved the weights", and a run in which none did raises
NothingTrainedError once everything is saved (exit 3 from the command line).

Every recipe writes the same run directory (config.yaml, run.json, metrics.jsonl,
samples/, checkpoints/) and the same metric keys, so runs of different
algorithms compare directly (`python -m flywheel.runs compare`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch

from flywheel.cli import NothingTrainedError, keep_until_exit, note_run_dir
from flywheel.distributed import all_reduce_mean
from flywheel.grids import judged_sample_grid
from flywheel.guards import check_finite
from flywheel.hacking_watch import HackingWatch
from flywheel.lora import lora_state_dict, save_lora_for_diffusers
from flywheel.prompts import load_prompts
from flywheel.recipe.best import LORA_DIRNAME, WEIGHTS_FILENAME, BestCheckpoint
from flywheel.recipe.ema import WeightEMA, first_ema_move, train_ema_decay
from flywheel.recipe.hacking_stop import HackingStop
from flywheel.recipe.preflight import warn
from flywheel.recipe.policy import (AdapterOffVelocity, Policy, build_policy, fsdp_full_params, fsdp_not_applied,
                                    fsdp_optimizer_state, load_fsdp_optimizer_state, make_optimizer, uses_fsdp)
from flywheel.recipe.rollouts import Rollouts
from flywheel.config.sections import eval_request_kwargs
from flywheel.runs.checkpoint import (MODEL_FILE, TRAINER_STATE_FILE, CheckpointError, check_optimizer_names,
                                      load_checkpoint, load_trainable, read_optimizer_state, save_checkpoint,
                                      set_aside_checkpoints_after)
from flywheel.config.parsing import config_to_dict, save_config
from flywheel.runs.deferred_signals import signals_deferred
from flywheel.runs.resume import ResumeError, record_resume, resume_changes
from flywheel.runs.rundir import (ABANDONED_DIRNAME, RUN_INFO_FILENAME, RunDir, RunDirInUseError,
                                  atomic_write_bytes, atomic_write_text)
from flywheel.runs.tracking import end_trackers, log_images, log_videos, prepare_tracker, tracker_names
from flywheel.video import is_video, middle_frame, sample_file_name, write_mp4, write_wav
from rewards.judges import judges_for_card
from rewards.registry import get as get_scorer

# Checkpointed tensors of a recipe's own (a sampling policy, an EMA) travel beside the trained weights
# under this prefix, and are handed back to the recipe on resume.
RECIPE_TENSOR_PREFIX = "recipe/"
# the EMA average of the trained weights in a checkpoint (its own prefix: a recipe's tensors stay its own).
EMA_TENSOR_PREFIX = "ema/"

# Row keys whose mean must be finite: a NaN there stops the run at its step.
FINITE_KEYS = ("loss", "kl", "ref_mse")

# The training loop's counters in trainer_state.json, each a whole number from 0 to at most the checkpoint's
# step: each count moves at most once a step, and so does the weight version, which may be one ahead (an
# engine process or a Ray pool starts at version 1, the first sync). A value outside that range was written by
# hand, and a resume would carry it into every output's weight-version stamp.
LOOP_COUNTERS = {"weight_version": 1, "skipped_steps": 0, "masked_run": 0, "flat_run": 0}  # name -> past step


def check_loop_state(trainer_state: dict) -> None:
    """ValueError naming the first counter of `trainer_state` that no run of this library could have saved."""
    step = trainer_state["step"]
    if "weight_version" not in trainer_state:
        raise ValueError(f"{TRAINER_STATE_FILE} has no 'weight_version'; a checkpoint this library wrote has one")
    for name, ahead in LOOP_COUNTERS.items():
        value = trainer_state.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= step + ahead:
            raise ValueError(f"{TRAINER_STATE_FILE} has {name}={value!r}; valid: a whole number from 0 to "
                             f"{step + ahead} (the checkpoint's step {step}{' + 1' if ahead else ''})")
    # data_position is checked against the prompt sampler's own position for the step, in begin().


class RecipeRun:
    """The run-level machinery of a recipe, which the training loop (flywheel/recipe/training_loop.py) drives."""

    def __init__(self, cfg, recipe: str):
        from accelerate import Accelerator

        self.cfg, self.recipe = cfg, recipe
        self._tracker_kwargs = prepare_tracker(cfg.tracker, Path(cfg.run_dir))
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                       log_with=tracker_names(cfg.tracker) or None,
                                       project_dir=cfg.run_dir)
        fallback = fsdp_not_applied(self.accelerator)
        if fallback is not None:
            warn(fallback)
        self.dir: RunDir | None = None  # created by `resume`, once the model is built and checked
        if self.accelerator.device.type == "cpu":
            # threads=, else the user's OMP_NUM_THREADS or lowered count, else the cores shared among the ranks.
            from flywheel.recipe.threads import set_rank_threads
            set_rank_threads(cfg.threads, self.accelerator.num_processes)
        self.start_step, self.version, self.trainer_state = 0, 0, {}
        self.recipe_tensors: dict[str, torch.Tensor] = {}
        self.ema: WeightEMA | None = None  # the EMA average, held by the main process (it evaluates and saves)
        self.wall_offset = 0.0  # wall seconds of the run before a resume
        self.best: BestCheckpoint | None = None  # best/, kept by the main process once train() starts
        self.hacking_stop = HackingStop(0)
        self.full_params = None
        # Under FSDP the checkpoint's optimizer state is loaded into the shards once `prepare` has made them.
        self._optimizer_state_to_shard: dict | None = None
        self._resumed_lr: float | None = None  # a learning rate the resume changed (it outranks the checkpoint's)
        self.train_transformer = None  # the prepared (DDP/FSDP-wrapped) transformer, once `prepare` ran

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def _open_run_dir(self) -> RunDir:
        """The run directory, locked by the main process for the whole run.

        A run dir belongs to one run: a fresh run refuses a used one unless told to overwrite it, and any run
        refuses one another process runs in. Only the main process checks; its refusal is sent to every rank,
        so that all of them stop with it instead of waiting for it at the next collective.
        """
        cfg = self.cfg
        refusal, run_dir = None, None
        try:
            run_dir = RunDir(cfg.run_dir, mode="resume" if cfg.resume else "overwrite" if cfg.overwrite else "new",
                             tracker_dirs=(cfg.project, "mlruns"), is_main_process=self.is_main, lock=True)
        except RunDirInUseError as e:
            refusal = e
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            message = broadcast_object_list([None if refusal is None else str(refusal)])[0]
            if message is not None:
                refusal = refusal or RunDirInUseError(message)
                # The main rank leaves this barrier only once every rank has the message (its exit could
                # otherwise cut the broadcast short); a rank that meets the main one gone stops all the same.
                try:
                    self.accelerator.wait_for_everyone()
                except Exception:
                    pass
        if refusal is not None:
            raise refusal
        return run_dir

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # --- setup ------------------------------------------------------------------------------------

    def resume(self, policy: Policy, optimizer) -> None:
        """Load the checkpoint named by resume= (weights, optimizer, RNG, trainer state, the EMA average);
        for a fresh run, save its config and start the EMA average at the weights as they are.

        The recipe's own checkpointed tensors (see `save`) land in `self.recipe_tensors`.
        """
        cfg = self.cfg
        self._open_dir()
        if not cfg.resume:
            if self.is_main:
                save_config(cfg, self.dir.path / "config.yaml")
                atomic_write_text(self.dir.path / RUN_INFO_FILENAME,
                                  json.dumps({"recipe": self.recipe, "card": cfg.model.card}) + "\n")
            self.ema = self._start_ema(policy, None)
            return
        sharded = uses_fsdp(self.accelerator)
        try:
            # resolve_resume verified its checksums a moment ago; load checks names, sizes and finiteness.
            state, trainer_state = load_checkpoint(cfg.resume, optimizer=None if sharded else optimizer,
                                                   named_params=policy.named_params, checksums=False)
            trained = {k: v for k, v in state.items() if not k.startswith((RECIPE_TENSOR_PREFIX, EMA_TENSOR_PREFIX))}
            load_trainable(policy.named_params, trained, cfg.resume)  # strict: every trained tensor, nothing else
            check_loop_state(trainer_state)
            if sharded:  # the whole state, by name, for `prepare` to load into this rank's shards
                self._optimizer_state_to_shard = read_optimizer_state(cfg.resume)
                check_optimizer_names(cfg.resume, self._optimizer_state_to_shard,
                                      [[n for n, _ in policy.named_params]])
        except (CheckpointError, ValueError) as e:
            raise ResumeError(" ".join(f"resume={cfg.resume}: {e}".split())) from None
        self.recipe_tensors = _with_prefix(state, RECIPE_TENSOR_PREFIX)
        ema_state = _with_prefix(state, EMA_TENSOR_PREFIX)
        self.ema = self._start_ema(policy, ema_state)
        self.start_step, self.version = trainer_state["step"], trainer_state["weight_version"]
        self.trainer_state = trainer_state
        # The config's learning rate outranks the one the checkpoint's param_groups brought back: a rate changed
        # by an earlier resume that was killed before its first checkpoint is in config.yaml but not in the
        # checkpoint (no schedule moves the rate, so the config's value is the one to train with).
        self._resumed_lr = cfg.train.learning_rate
        self._set_resumed_lr(optimizer)
        # config.yaml and metrics.jsonl are rewritten only in begin(), once every resume check has passed.

    def _record_resume(self) -> None:
        """The resume's writes, after its checks: metrics rows after the checkpoint dropped (the first write:
        a metrics file that cannot be read is refused before anything changes), the changed keys recorded, the
        wall clock continued."""
        cfg = self.cfg
        # Which checkpoint this session continues, said once its checks passed (the run dir's newest complete
        # one, or the one resume= named): a resume that picked an older one than expected is seen at once.
        print(f"resume: continuing from {cfg.resume} (step {self.start_step}, weight version {self.version}) "
              f"to step {cfg.steps}", file=sys.stderr, flush=True)
        try:
            self.dir.metrics.truncate_after(self.start_step)  # rows a killed run wrote after its last checkpoint
        except ValueError as e:
            raise ResumeError(f"resume={cfg.resume}: {e}; fix or remove that line, then resume again") from None
        # The keys the command line changed (resume_config allowed each): they take effect, and are recorded.
        changes = resume_changes(cfg)
        if changes:
            record_resume(cfg, self.start_step, changes)
            listed = ", ".join(f"{key}={now!r} (was {was!r})" for key, (was, now) in changes.items())
            print(f"resume at step {self.start_step}: {listed}; recorded in {self.dir.config_path} under "
                  "resume_overrides", file=sys.stderr, flush=True)
        self._set_aside_later_work()
        # time/wall_s continues from the checkpoint's step, so curves against wall time join up.
        walls = [r["time/wall_s"] for r in self.dir.metrics.read() if "time/wall_s" in r]
        self.wall_offset = walls[-1] if walls else 0.0

    def _set_aside_later_work(self) -> None:
        """Checkpoints past the resumed one and a best/ evaluated after it belong to the steps this run now
        replays (or, from an older checkpoint, to a timeline it abandons): moved into abandoned/, so that
        neither a later resume nor best/ picks them up, and the replay writes its own."""
        run_dir = self.dir.path
        into = run_dir / ABANDONED_DIRNAME / f"after_step_{self.start_step}_{time.strftime('%Y%m%dT%H%M%S')}"
        moved = set_aside_checkpoints_after(run_dir, self.start_step, into)
        best = BestCheckpoint(run_dir)  # puts back a best/ a killed swap left aside
        if best.step is not None and best.step > self.start_step:
            into.mkdir(parents=True, exist_ok=True)
            os.replace(best.path, into / best.path.name)
            moved.append(f"{best.path.name}/ (step {best.step})")
        if moved:
            # Never deleted by the run (it is the user's), so its size is said: each such resume adds a copy.
            held = _tree_bytes(run_dir / ABANDONED_DIRNAME)
            print(f"resume at step {self.start_step}: set aside what the run wrote after it ({', '.join(moved)}) "
                  f"in {into}; the steps from here are trained again ({run_dir / ABANDONED_DIRNAME} now holds "
                  f"{held / 2**20:.1f} MiB; delete what you no longer need)", file=sys.stderr, flush=True)

    def _open_dir(self) -> None:
        """Create (or take over) the run directory: only now, after every check and the model build (the
        model's own checks: LoRA targets, the card's size rules), so a refused run leaves nothing to overwrite."""
        self.dir = self._open_run_dir()  # locked for the whole run
        note_run_dir(self.dir.path)  # named by the line an interrupted run ends on
        self.accelerator.wait_for_everyone()

    def _start_ema(self, policy: Policy, checkpointed: dict[str, torch.Tensor] | None) -> WeightEMA | None:
        """the EMA average on the main process: the weights of a fresh run, the checkpoint's on resume."""
        if not self.cfg.ema.enabled:
            if checkpointed and self.is_main:  # allowed (evaluation on the trained weights), but never silently
                print(f"warning: resume={self.cfg.resume} holds an EMA average and this run has ema.enabled="
                      "false: the average is dropped, and the next checkpoints will not hold it (resume with "
                      "ema.enabled=true to keep it)", file=sys.stderr, flush=True)
            return None
        if checkpointed is not None and not checkpointed:  # checked on every rank: they all stop together
            raise ResumeError(f"resume={self.cfg.resume}: the checkpoint holds no EMA average (its run had "
                              "ema.enabled=false); resume with ema.enabled=false, or start a fresh run")
        if not self.is_main:
            return None
        ema = WeightEMA(policy.named_params, what="the EMA average")
        if checkpointed:
            ema.load_state_dict(checkpointed)
        return ema

    def _set_resumed_lr(self, optimizer) -> None:
        """A learning rate the resume changed replaces the one the checkpoint's param_groups brought back."""
        if self._resumed_lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = self._resumed_lr

    def trained_policy(self, reference: bool):
        """The policy every recipe trains, ready for the launch: built on this run's device (with a frozen
        reference when `reference`), its optimizer from cfg.train, both resumed from the checkpoint (if any),
        then prepared (DDP, FSDP). Returns (policy, train_transformer, optimizer)."""
        policy = build_policy(self.cfg, self.device, reference=reference)
        optimizer = make_optimizer(policy, self.cfg.train)
        self.resume(policy, optimizer)
        transformer, optimizer = self.prepare(policy, optimizer)
        return policy, transformer, optimizer

    def prepare(self, policy: Policy, optimizer):
        """Wrap the transformer and optimizer for the launch (DDP, FSDP); returns (train_transformer, optimizer)."""
        train_transformer, optimizer = self.accelerator.prepare(policy.transformer, optimizer)
        if self.accelerator.num_processes > 1:
            # The DDP wrapper holds the process group: freeing it can hang the rank (see flywheel.cli).
            keep_until_exit(train_transformer)
        # FSDP shards model.transformer's parameters in place; the engine's rollouts (and checkpoints)
        # need them whole: gather them for the duration, on every rank (the gather is a collective).
        self.full_params = fsdp_full_params(self.accelerator, train_transformer)
        policy.whole_weights = self.full_params  # weight syncs that copy the weights out gather them first
        if uses_fsdp(self.accelerator) and isinstance(policy.ref_velocity, AdapterOffVelocity):
            policy.ref_velocity.forward_module = train_transformer  # the wrapper gathers the base weights
        if self._optimizer_state_to_shard is not None:
            raw = getattr(optimizer, "optimizer", optimizer)
            load_fsdp_optimizer_state(train_transformer, raw, self._optimizer_state_to_shard)
            self._set_resumed_lr(raw)
            self._optimizer_state_to_shard = None
        self.policy, self.optimizer = policy, optimizer
        self.train_transformer = train_transformer
        return train_transformer, optimizer

    # --- the blocks the training loop (flywheel/recipe/training_loop.py) uses ------------------------

    def begin(self, rollouts: Rollouts) -> None:
        """Before the first step and before the run's clock (set-up, like model loading): the resume's data
        position checked, judges (an SVC fit takes ~0.4 s), the hacking watch (fed the evaluations before a
        resume), best/, trackers. Then `base_evaluation`."""
        cfg, accelerator = self.cfg, self.accelerator
        if rollouts.flywheel.sampler.position(self.start_step) != self.trainer_state.get(
                "data_position", rollouts.flywheel.sampler.position(self.start_step)):
            raise ResumeError(f"resume={cfg.resume}: the checkpoint was at data position "
                              f"{self.trainer_state['data_position']} but step {self.start_step} of these prompts "
                              f"is at {rollouts.flywheel.sampler.position(self.start_step)}: the prompts of data.prompts "
                              "changed since it was saved")
        saved_sha = self.trainer_state.get("data_sha256")  # absent in checkpoints written before it was kept
        if cfg.resume and saved_sha is not None and saved_sha != rollouts.flywheel.sampler.fingerprint():
            raise ResumeError(f"resume={cfg.resume}: the prompts of data.prompts ({cfg.data.prompts}) changed since "
                              "the checkpoint was saved (the same number, other text or metadata): resume with the "
                              "prompts it trained on, or start a new run")
        if cfg.resume and self.is_main:
            self._record_resume()
        self.rollouts = rollouts
        self.judges = {**judges_for_card(cfg.model.card), **eval_judges(cfg.eval.judges)} if self.is_main else {}
        self.watch = HackingWatch()  # reward rising while the judge falls, overall or in one class
        self.best = BestCheckpoint(self.dir.path) if self.is_main else None
        self.hacking_stop = HackingStop(cfg.eval.stop_on_hacking, self.trainer_state)
        if cfg.eval.stop_on_hacking and self.is_main and not self.judges:
            print(f"warning: eval.stop_on_hacking={cfg.eval.stop_on_hacking} has no effect: the {cfg.model.card} "
                  "card has no judges, so the hacking watch never fires", file=sys.stderr, flush=True)
        for earlier in (self.dir.metrics.read() if cfg.resume and self.is_main else []):
            if "eval/reward/mean" in earlier:  # a resumed run keeps comparing with the evaluations before it
                self.watch.observe(earlier, earlier["step"])
        if tracker_names(cfg.tracker):
            accelerator.init_trackers(cfg.project, config=_flatten(config_to_dict(cfg)),
                                      init_kwargs=self._tracker_kwargs)

    def base_evaluation(self) -> dict | None:
        """The step-0 evaluation of a fresh run (returned, logged; the first thing time/wall_s counts); None on
        a resume."""
        if self.start_step != 0:
            return None
        with self.full_params():
            base_eval = self.evaluate(0)
        self.log({"step": 0, "weight_version": self.rollouts.version, "time/wall_s": 0.0, **base_eval})
        return base_eval

    def progress(self):
        """The run's progress bar (main process), from the step it starts at."""
        return _progress(self.recipe, self.is_main, self.start_step, self.cfg.steps)

    def show_progress(self, progress, row: dict, version: int, skipped: int) -> None:
        progress.update(1)
        progress.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}",
                             **{k: f"{row[k]:.2e}" for k in ("kl", "ref_mse") if k in row}, v=version,
                             **({"skipped": skipped} if skipped else {}),
                             **({"HACKING?": self.watch.last.short} if self.watch.last.short else {}))

    @staticmethod
    def check_row(row: dict) -> None:
        """A non-finite mean loss (or KL, or distance to the reference) stops the run at its step."""
        for key in FINITE_KEYS:
            if key in row:
                check_finite(row[key], f"the mean {key}", row["step"])

    def end(self, base_eval: dict | None, row: dict, skipped: int, skip_reasons: dict[str, int],
            stopping: bool) -> dict:
        """After the last step (or an eval.stop_on_hacking stop): the finish lines and the run's summary."""
        self.skip_reasons = skip_reasons
        stopped = None
        if stopping:
            stopped = self.hacking_stop.reason(row["step"], self.best and self.best.step,
                                               self.best and (self.best.state or {}).get("reward"),
                                               self.dir.checkpoints_dir) if self.is_main else "stopped"
        summary = self.finish(base_eval, row, skipped)
        if stopped is not None:
            summary["stopped"] = stopped
            if self.is_main:
                print(stopped, flush=True)
        return summary

    def move_ema(self, steps_done: int) -> dict:
        """After a training step: move the EMA average on its schedule (`train_ema_decay`); its metrics.

        Once per training step rather than per optimizer step: the unit of every step key, and a state that
        every checkpoint ends on. A step that took no optimizer step still counts (the weights stayed).
        """
        if not self.cfg.ema.enabled:
            return {}
        decay = train_ema_decay(steps_done, self.cfg.ema)
        if decay is None:
            return {}
        with self.full_params():  # a collective under FSDP: every rank enters, the main process averages
            if self.ema is not None:
                self.ema.update(self.policy.named_params, decay)
        return {"ema/decay": decay}

    def ema_weights(self):
        """A context in which the trained module holds the EMA average (a no-op without ema.enabled)."""
        if self.ema is None:
            return contextlib.nullcontext()
        return self.policy.weights_swapped(self.ema.shadow)

    def evaluate(self, step: int) -> dict:
        """Evaluate on the main process (judges, per-class metrics, the hacking watch); save and log a sample grid."""
        if not self.is_main:
            return {}
        cfg = self.cfg
        items = load_prompts(cfg.data.eval_prompts)
        # With ema.enabled the evaluation engine's module runs the average for these samples only: the weights are
        # back, bit for bit, before the next rollout, and the engine's version (which names the trained
        # weights, and which no swap bumps) is left alone. eval/ema says which weights were measured.
        with self.ema_weights():
            metrics, traj = self.rollouts.eval_samples(items, cfg.eval.seeds,
                                                   eval_request_kwargs(cfg.sampling, cfg.eval), self.judges)
        if self.ema is not None:
            metrics["eval/ema"] = 1.0
        watched = self.watch.observe(metrics, step)
        metrics.update(watched.metrics)
        self.hacking_stop.observe(metrics)
        if self.best is not None:
            self.best.consider(step, metrics, self._write_best)
            metrics.update(self.best.metrics())
        if watched.new:  # printed once when it starts; the progress bar shows it while it lasts
            _progress_write(f"step {step}: {watched.warning}")
        if step % cfg.sample_every == 0 or step == cfg.steps:
            # One image per prompt, first seed: a row per class for the toy tasks, framed by the judge's verdict.
            first = slice(None, None, cfg.eval.seeds)
            shown = traj.images[first].detach().cpu()
            if is_video(shown):
                # With the sound of a joint audio+video card muxed in, at the card's frame rate.
                audio = traj.audio[first].detach().cpu() if getattr(traj, "audio", None) is not None else None
                fps = self.policy.card_defaults.get("fps", 16)
                names = [str(p) for p in traj.prompts[first]]
                paths = [write_mp4(v, self.dir.samples_dir / sample_file_name(step, i, names[i], ".mp4"), fps=fps,
                                   audio=None if audio is None else audio[i],
                                   sample_rate=None if audio is None else traj.audio_sample_rate)
                         for i, v in enumerate(shown[:8])]
                for i, sound in enumerate([] if audio is None else audio[:8]):  # the sound alone, lossless
                    write_wav(sound, traj.audio_sample_rate,
                              self.dir.samples_dir / sample_file_name(step, i, names[i], ".wav"))
                log_videos(self.accelerator, "eval/videos", paths, step)
                shown = middle_frame(shown)
            grid = judged_sample_grid(shown, traj.prompts[first], traj.metadata[first], self.judges,
                                      nrow=len(items) // 10 or None)
            png = io.BytesIO()
            grid.save(png, format="PNG")
            atomic_write_bytes(self.dir.sample_path(step), png.getvalue())  # a kill leaves no torn grid
            log_images(self.accelerator, "eval/samples", [grid], step)
        return metrics

    def stop_for_hacking(self) -> bool:
        """After an evaluation: whether eval.stop_on_hacking's streak is reached (the main process counts; every
        rank gets its answer, so they all leave the loop together)."""
        if not self.cfg.eval.stop_on_hacking:
            return False
        verdict = all_reduce_mean({"stop": float(self.is_main and self.hacking_stop.should_stop)})
        return verdict["stop"] > 0

    def _write_best(self, folder) -> dict:
        """best/'s files: the weights as evaluated (the EMA average when on) and, for LoRA, the adapter."""
        from safetensors.torch import save_file

        lora = self.cfg.model.finetune == "lora"
        with self.ema_weights():
            save_file({n: p.detach().cpu().contiguous() for n, p in self.policy.named_params},
                      str(folder / WEIGHTS_FILENAME))
            if lora:
                pipeline = self.policy.card_defaults.get("diffusers_pipeline")
                if pipeline:
                    save_lora_for_diffusers(self.policy.transformer, folder / LORA_DIRNAME, pipeline)
                else:
                    (folder / LORA_DIRNAME).mkdir()
                    save_file(lora_state_dict(self.policy.transformer),
                              str(folder / LORA_DIRNAME / "adapter_model.safetensors"))
        return {"ema": self.ema is not None, "lora": lora}

    def log(self, row: dict) -> None:
        if self.is_main:
            self.dir.metrics.append(row)
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def save(self, step: int, trainer_state: dict, recipe_tensors: dict[str, torch.Tensor]) -> None:
        """Checkpoint the trained weights, the optimizer, RNG and trainer state (and the recipe's tensors, and
        the EMA average: the trained weights stay the ones a resume continues from)."""
        if self.cfg.eval.stop_on_hacking:  # the streak continues across a resume
            trainer_state = {**trainer_state, **self.hacking_stop.state()}
        raw_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        # Under FSDP each rank's optimizer holds its flat shards: the checkpoint holds the gathered whole, named
        # as a plain run's (a collective, outside the parameters' gather).
        gathered = fsdp_optimizer_state(self.train_transformer, raw_optimizer) if uses_fsdp(self.accelerator) else None
        with self.full_params():
            if self.is_main:
                tensors = {n: p.detach() for n, p in self.policy.named_params}
                tensors.update({RECIPE_TENSOR_PREFIX + k: v.detach() for k, v in recipe_tensors.items()})
                if self.ema is not None:
                    tensors.update({EMA_TENSOR_PREFIX + k: v for k, v in self.ema.state_dict().items()})
                # A Ctrl-C or SIGTERM here waits for the write: it used to discard the checkpoint half-written.
                with signals_deferred(f"the checkpoint of step {step}"):
                    save_checkpoint(self.dir.checkpoints_dir, step, tensors,
                                    None if gathered is not None else raw_optimizer,
                                    self.policy.named_params, {"step": step, **trainer_state},
                                    keep_last=self.hacking_stop.keep_last(self.cfg.keep_checkpoints),
                                    optimizer_state=gathered)
                self.hacking_stop.saved(step)
        self.accelerator.wait_for_everyone()

    def _export_lora(self, folder: Path, pipeline: str | None) -> None:
        if pipeline:
            save_lora_for_diffusers(self.policy.transformer, folder, pipeline)
            return
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".adapter_model.safetensors.tmp"  # renamed into place: a kill leaves no torn file
        save_file(lora_state_dict(self.policy.transformer), str(tmp))
        os.replace(tmp, folder / "adapter_model.safetensors")

    def finish(self, base_eval: dict | None, row: dict, skipped: int = 0) -> dict:
        """Save the LoRA for diffusers (lora/: the trained adapter; lora_ema/: the EMA average, when on),
        print base -> final and which adapter is which, end the trackers. A NaN final eval fails the run, and so
        does a run in which no step took an optimizer step (NothingTrainedError), both once everything is saved.
        `skipped`: the run's steps (all sessions) that took no optimizer step."""
        cfg = self.cfg
        exported: list[tuple[Path, str]] = []
        zero_adapter = False
        if cfg.model.finetune == "lora":
            # The adapters in the format a stock pipeline's load_lora_weights(run_dir / "lora") reads; a card
            # without a diffusers pipeline (the toys) gets peft's tensors in lora/adapter_model.safetensors.
            pipeline = self.policy.card_defaults.get("diffusers_pipeline")
            with self.full_params():
                if self.is_main:
                    self._export_lora(self.dir.path / "lora", pipeline)
                    zero_adapter = _all_lora_b_zero(dict(self.policy.named_params))  # whole weights here
                    exported.append((self.dir.path / "lora", "the trained adapter"))
                    if self.ema is not None:
                        with self.ema_weights():
                            self._export_lora(self.dir.path / "lora_ema", pipeline)
                        exported.append((self.dir.path / "lora_ema", "the EMA average of the trained adapter"
                                         " (the one evaluation used)"))
            self.accelerator.wait_for_everyone()
        if not row and self.start_step >= cfg.steps > 0:
            # A resume of a run that has all its steps: this session trained nothing, and the run's final
            # evaluation is the one it logged at its last step (not a NaN from a session without one).
            row = self._logged_row(self.start_step)
            if self.is_main:
                print(f"resume at step {self.start_step}: the run already has its {cfg.steps} steps, so this "
                      f"session trained nothing; give steps > {cfg.steps} to train on", flush=True)
        final_eval = {k: v for k, v in row.items() if k.startswith("eval/")}
        done = row.get("step", self.start_step)  # a run stopped by eval.stop_on_hacking ends early
        trained = done - skipped
        if self.is_main:
            for warning in self._unmoved_warnings(exported, zero_adapter):
                print(f"warning: {warning}", file=sys.stderr, flush=True)
            base = base_eval if base_eval is not None else self._first_eval()
            measured = " (of the EMA average)" if self.ema is not None else ""
            print(f"eval reward: base {base.get('eval/reward/mean', float('nan')):.3f} -> "
                  f"final {final_eval.get('eval/reward/mean', float('nan')):.3f}{measured} (run dir {self.dir.path})",
                  flush=True)
            for path, what in exported:
                print(f"{path}: {what}", flush=True)
            if 0 < trained < done:
                print(f"warning: {self._trained_line(trained, done)}", file=sys.stderr, flush=True)
        end_trackers(self.accelerator)  # trackio's run finished once
        if self.is_main and "eval/reward/mean" in final_eval:
            # Everything is saved; a NaN final evaluation still makes the run fail rather than exit 0.
            check_finite(final_eval["eval/reward/mean"], "the final evaluation reward", cfg.steps,
                         "every evaluation sample was masked: see the eval/reward/*/invalid metrics")
        summary = {"base": base_eval, "final": final_eval, "run_dir": str(self.dir.path),
                   "trained_steps": trained, "steps": cfg.steps}
        if trained == 0 and done > 0:
            raise NothingTrainedError(f"{self._trained_line(trained, done)}: the weights are the ones the run started "
                                      f"from (everything is saved in {self.dir.path})", summary)
        return summary

    def _trained_line(self, trained: int, done: int) -> str:
        """"N of M steps moved the weights" (M: the steps the run has done), with why this session's others did
        not (no optimizer step, or one that only rounded)."""
        why = "; ".join(f"{n} skipped: {reason}" for reason, n in self.skip_reasons.items())
        return f"{trained} of {done} steps moved the weights" + (f" ({why})" if why else "")

    def _unmoved_warnings(self, exported: list[tuple[Path, str]], zero_adapter: bool) -> list[str]:
        """Why an exported adapter (or the EMA average) is still the one the run started from, if it is."""
        out = []
        names = [p.name for p, _ in exported]
        if zero_adapter:
            out.append(f"{self.dir.path / 'lora'}: every lora_B of the trained adapter is zero, so it changes "
                       "nothing (no optimizer step moved it)")
        if self.ema is None:
            return out
        ec = self.cfg.ema
        where = f"{self.dir.path / 'lora_ema'} and the evaluation" if "lora_ema" in names else "the evaluation"
        if self.cfg.steps < first_ema_move(ec):
            out.append(f"the EMA average never moved: it moves after every ema.update_every="
                       f"{ec.update_every}-th step from ema.start_step={ec.start_step}, and this run "
                       f"has steps={self.cfg.steps}; {where} use the weights the run started from (lower "
                       f"ema.update_every, or take {self._trained_weights_where()})")
        elif not self.ema.moved:
            out.append(f"the EMA average still equals the weights the run started from (no step moved "
                       f"them before it was updated); {where} use those weights")
        elif "lora_ema" in names and _all_lora_b_zero(self.ema.shadow):
            out.append(f"{self.dir.path / 'lora_ema'}: every lora_B of the EMA average is zero, so it "
                       "changes nothing")
        return out

    def _trained_weights_where(self) -> str:
        """Where the trained weights (not the EMA average) are once the run ends: lora/ for a LoRA, else the last
        checkpoint's (training_loop saves one at the last step)."""
        if self.cfg.model.finetune == "lora":
            return "lora/, the trained adapter"
        return (f"the trained weights: {MODEL_FILE} of the last checkpoint in {self.dir.checkpoints_dir}, whose "
                f"{EMA_TENSOR_PREFIX!r} tensors are the average")

    def _first_eval(self) -> dict:
        rows = [r for r in self.dir.metrics.read() if r.get("step") == 0]
        return rows[0] if rows else {}

    def _logged_row(self, step: int) -> dict:
        """The last row metrics.jsonl holds for `step` ({} when none: a worker, or a run that logged none)."""
        rows = [r for r in self.dir.metrics.read() if r.get("step") == step] if self.is_main else []
        return rows[-1] if rows else {}


def _tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _all_lora_b_zero(named: dict[str, torch.Tensor]) -> bool:
    """Whether a LoRA's every lora_B weight is zero (peft starts them so): the adapter is then the identity."""
    b = [t for name, t in named.items() if "lora_B" in name]
    return bool(b) and all(not bool(t.detach().any()) for t in b)


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
    """The scorers named in `eval.judges` (comma-separated), built to evaluate only, by name."""
    return {name: get_scorer(name) for name in (n.strip() for n in names.split(",")) if name}
