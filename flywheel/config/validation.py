"""One check per config section, and `check_shared_sections`, which runs them all before a run does any work.

Each `check_<section>(cfg, checks)` records the problems of its section's keys (and of the few that span two
sections) in a `ConfigChecks`; the recipe then adds its own (`validate_config` in trainers/<algo>.py) and one
ConfigError lists every problem, each a line naming the key, its value and what is valid. The checks that
look beyond the values (the run directory, the model folder, the scorers' folders and servers) are in
flywheel/recipe/preflight.py and run last, still before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from engine import get_card, list_cards
from flywheel.config.parsing import ConfigError
from flywheel.prompts import load_prompts
from flywheel.recipe.preflight import (check_bounds, check_judge_servers, check_minibatches, check_model_path,
                                      check_ray_address, check_workflow_paths,
                                       check_reward_keys, check_rewards, check_run_dir, fsdp_requested,
                                       launch_world_size, remote_prompt_coverage, warn, warn_prompts_per_step)
from flywheel.runs.compare import format_config_value
from rewards.registry import REMOTE, parse_spec_targets, prompt_coverage

POSITIVE = "must be an integer >= 1"


# ---- collecting the problems: ConfigChecks ----------------------------------------------------------------------


def config_value(cfg: Any, key: str) -> Any:
    """The value at a dotted key of a config dataclass ("train.learning_rate")."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# The largest float32: the losses, rewards and weights are float32 (or narrower), so a coefficient beyond it
# (kl_beta=1e300) becomes inf in the first step's arithmetic, after the run directory was written.
FLOAT32_MAX = 3.4028234663852886e38


def _finite_float32(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def non_finite_fields(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every float field (or float inside a tuple/list field) that is NaN, inf, or beyond
    float32's range."""
    bad = []
    for name in (f.name for f in dataclasses.fields(cfg) if f.init):
        value, key = getattr(cfg, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            bad += non_finite_fields(value, f"{key}.")
        elif isinstance(value, float) and not _finite_float32(value):
            bad.append(key)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, float) and not _finite_float32(v) for v in value):
            bad.append(key)
    return bad


class ConfigChecks:
    """Collects every problem of a config, then raises one ConfigError that lists them all.

        checks = ConfigChecks(cfg)
        checks.require("steps", lambda v: v >= 1, "a positive number of training steps")
        checks.raise_if_any()
    """

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._non_finite = non_finite_fields(cfg)
        self.problems = [f"{key}={config_value(cfg, key)}: must be a finite number of at most {FLOAT32_MAX:.4g} "
                         "in magnitude (float32's range, in which the run computes)" for key in self._non_finite]

    def require(self, key: str, ok: Callable[[Any], bool], valid: str, allow_none: bool = False) -> None:
        """Record `key` as invalid unless `ok(value)` (None passes when `allow_none`); `valid` says what is."""
        value = config_value(self.cfg, key)
        if (value is None and allow_none) or key in self._non_finite:  # a non-finite value is reported once
            return
        try:
            good = value is not None and bool(ok(value))
        except (TypeError, ValueError):
            good = False
        if not good:
            self.problems.append(f"{key}={value!r}: {valid}")

    def fail(self, message: str) -> None:
        """Record a problem that spans several keys (the message names them)."""
        self.problems.append(message)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(self.problems))


# ---- the checks, one per section --------------------------------------------------------------------------------


def check_shared_sections(cfg) -> ConfigChecks:
    """Check every shared section (run, model, data, sampling, train's optimizer keys, reward, advantage, ema,
    eval, rollout, workflow); the recipe adds its own, then raises.

    Returns the ConfigChecks so that every bad key, shared or the recipe's, comes in one ConfigError.
    """
    checks = ConfigChecks(cfg)
    for check in (check_run, check_model, check_data, check_sampling, check_optimizer, check_reward,
                  check_advantage, check_ema, check_eval, check_rollout, check_workflow, check_switched_keys,
                  check_ray_keys):
        check(cfg, checks)
    check_bounds(cfg, checks)
    check_environment(cfg, checks)
    return checks


class When:
    """A switch that is on when `test(value)` holds, written `condition` after the key (" > 0"); `fix` after the
    key says how to turn it on (default: the condition)."""

    def __init__(self, test, condition: str, fix: str | None = None):
        self.test, self.condition, self.fix = test, condition, condition if fix is None else fix


ANY_VALUE = When(lambda v: v is not None, " set (not null)", "")  # train.timestep_fraction
ABOVE_ZERO = When(lambda v: v > 0, " > 0")  # a loss weight (anchor_beta) or a schedule's cap (eta_max)

# Keys that act only when a switch is on: (the switch, the value that turns it on (a tuple: any of them; a When:
# a test of the value), its keys). A recipe passes its own to check_switched_keys.
SWITCHED_KEYS = (
    ("model.finetune", "lora", ("model.lora_rank", "model.lora_alpha", "model.lora_targets", "model.lora_init")),
    ("ema.enabled", True, ("ema.decay", "ema.start_step", "ema.update_every")),
    ("rollout.asynchronous", True, ("rollout.max_staleness",)),
    ("rollout.backend", "ray", ("rollout.replicas", "rollout.cpus_per_replica", "rollout.gpus_per_replica",
                                "rollout.sync_backend")),
    ("rollout.sync_backend", ("nccl", "gloo"), ("rollout.sync_port",)),
    ("rollout.reward_actors", ABOVE_ZERO, ("rollout.cpus_per_reward_actor", "rollout.gpus_per_reward_actor")),
    ("tracker", When(lambda v: str(v).strip() != "none", " naming a tracker",
                     "=wandb (or tensorboard, trackio, mlflow)"), ("project",)),
    # The bounds of a remote: scorer's HTTP calls; no other scorer reads them.
    ("reward.scorers", When(lambda v: _names_remote(v), " naming a remote: scorer",
                            "=...,remote:http://HOST:PORT[:weight]"), ("reward.timeout_s", "reward.budget_s")),
)


def _names_remote(spec) -> bool:
    """Whether a reward spec names a remote: scorer, or vlm_judge, whose server probe reward.timeout_s also bounds
    (preflight.probe_seconds); a spec that does not parse counts as one: its own check reports it, and the
    bounds are not refused on top."""
    try:
        return any(target.startswith(REMOTE) or target == "vlm_judge" for _, target, _ in parse_spec_targets(spec))
    except ValueError:
        return True
# Ray's own keys, read by the replica pool and by the reward actors alike.
RAY_KEYS = ("rollout.address", "rollout.max_failures")
# Read wherever rollouts or rewards run outside the trainer's process: an engine process or Ray actors.
OUT_OF_PROCESS_KEYS = ("rollout.call_timeout_s", "rollout.start_timeout_s")


def set_away_from_default(cfg, keys, defaults=None) -> list[tuple[str, object]]:
    """(key, value) of each of `keys` whose value differs from the recipe's own default (`defaults`, else
    `type(cfg)()`: DPO's EMA is on, at decay 0.85), in order: the values a switch that is off, or a recipe that
    never reads them, would ignore."""
    defaults = type(cfg)() if defaults is None else defaults
    return [(key, config_value(cfg, key)) for key in keys if config_value(cfg, key) != config_value(defaults, key)]


def _switch_on(value, on) -> bool:
    if isinstance(on, When):
        return on.test(value)
    return value in on if isinstance(on, tuple) else value == on


def _switch_word(on) -> str:
    return " or ".join(map(_yaml_word, on)) if isinstance(on, tuple) else _yaml_word(on)


def check_switched_keys(cfg, checks: ConfigChecks, switched=SWITCHED_KEYS) -> None:
    """A key set away from the recipe's default while its switch is off would be ignored (a LoRA rank for a
    full fine-tune, an EMA decay without the EMA): refused, naming the switch."""
    if cfg.resume:
        # The run's saved keys passed this check when it started; a resume may turn ema.enabled off (a resumable
        # key) and cannot take the saved EMA keys out, so they are left alone.
        return
    defaults = type(cfg)()
    for switch, on, keys in switched:
        if _switch_on(config_value(cfg, switch), on):
            continue
        now = _yaml_word(config_value(cfg, switch))
        wanted = f"{switch}{on.condition}" if isinstance(on, When) else f"{switch}={_switch_word(on)}"
        fix = f"{switch}{on.fix}" if isinstance(on, When) else wanted
        for key, value in set_away_from_default(cfg, keys, defaults):
            checks.fail(f"{key}={_yaml_word(value)} with {switch}={now}: it acts only with {wanted}, so it "
                        f"would be ignored; set {fix} or leave it out")


def check_ray_keys(cfg, checks: ConfigChecks) -> None:
    """Ray's address and retry bound, set away from the default when neither the replica pool nor reward actors
    start Ray, would be ignored: refused (a resume is left alone, as in check_switched_keys)."""
    if cfg.resume or cfg.rollout.backend == "ray" or cfg.rollout.reward_actors > 0:
        return
    for key, value in set_away_from_default(cfg, RAY_KEYS):
        checks.fail(f"{key}={_yaml_word(value)} with rollout.backend={cfg.rollout.backend} and "
                    "rollout.reward_actors=0: no Ray is started, so it would be ignored; set "
                    "rollout.backend=ray or rollout.reward_actors > 0, or leave it out")
    if cfg.rollout.asynchronous:
        return
    for key, value in set_away_from_default(cfg, OUT_OF_PROCESS_KEYS):
        checks.fail(f"{key}={_yaml_word(value)} with rollout.backend={cfg.rollout.backend}, "
                    "rollout.asynchronous=false and rollout.reward_actors=0: everything runs in the trainer's "
                    "process, so it would be ignored; it bounds an engine process (rollout.asynchronous=true) or "
                    "Ray actors, so leave it out")


def _yaml_word(value) -> str:
    """A value as an override writes it: a list unquoted in brackets ([qkv]), the rest as format_config_value."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return format_config_value(value)


def check_run(cfg, checks: ConfigChecks) -> None:
    """The top-level run keys: step counts and cadences, the seed, threads and the trackers."""
    for key in ("steps", "sample_every", "save_every", "keep_checkpoints"):
        checks.require(key, lambda v: v >= 1, POSITIVE)
    checks.require("seed", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("threads", lambda v: v >= 0, "must be an integer >= 0 or null (0/null: OMP_NUM_THREADS, else "
                   "the cores divided among the processes)", allow_none=True)
    from flywheel.runs.tracking import missing_tracker_packages, tracker_names

    try:
        tracker_names(cfg.tracker)
    except ValueError as e:
        checks.fail(str(e))
    else:
        for message in missing_tracker_packages(cfg.tracker):  # a config error, not a traceback at set-up
            checks.fail(message)


def check_model(cfg, checks: ConfigChecks) -> None:
    """`model`: a known card, LoRA's rank and alpha, and a dtype its trained weights can be stepped in."""
    checks.require("model.lora_rank", lambda v: v >= 1, POSITIVE)
    if cfg.model.dtype == "float16" and cfg.model.finetune == "full":
        # AdamW's moments take the weights' dtype: float16 rounds its eps (1e-8) and squared gradients under
        # 6e-8 to 0, so the first step divides by zero and every weight is inf (a LoRA's adapter is float32).
        checks.fail("model.dtype=float16 with model.finetune=full: AdamW would keep its state in float16, which "
                    "rounds its eps (1e-8) and small squared gradients to 0, so the first step makes the weights inf; "
                    "use model.dtype=bfloat16 or float32, or model.finetune=lora (its adapter is float32)")
    checks.require("model.lora_alpha", lambda v: v > 0, "must be > 0")
    # An empty list would read as null (the card's own targets) where it says "no module": refused, not guessed.
    checks.require("model.lora_targets", lambda v: len(v) > 0, "names no module; give module names (e.g. [qkv]) "
                   "or leave it null for the card's own targets", allow_none=True)
    try:
        get_card(cfg.model.card)
    except (KeyError, ValueError) as e:
        checks.fail(f"model.card={cfg.model.card!r}: {e.args[0] if e.args else e}")  # str(KeyError) is a repr
    else:
        if cfg.model.experts is not None and "experts" not in get_card(cfg.model.card).defaults:
            checks.fail(f"model.experts={cfg.model.experts}: card {cfg.model.card!r} has one transformer; the key "
                        f"chooses the trained experts of a two-expert card ("
                        f"{', '.join(c for c in list_cards() if 'experts' in get_card(c).defaults)}); leave it unset")


# The built-in toy datasets and the toy card each is the task of: the other card's prompts and reward train
# nothing useful (digit_alignment squashes an 8x16 canvas of two digits to 8x8).
TOY_DATASET_CARDS = {"toy-digits": "toy-digits", "toy-digits-heldout": "toy-digits",
                     "toy-numbers": "toy-numbers", "toy-numbers-heldout": "toy-numbers"}
TOY_TASKS = {"toy-digits": "data.prompts=toy-digits data.eval_prompts=toy-digits-heldout "
                           "reward.scorers=digit_alignment:1.0",
             "toy-numbers": "data.prompts=toy-numbers data.eval_prompts=toy-numbers-heldout "
                            "reward.scorers=number_alignment:1.0 (as configs/toy_numbers_<recipe>.yaml do)"}


def check_toy_task(cfg, checks: ConfigChecks) -> None:
    """A toy card given the other toy card's built-in prompts (model.card=toy-numbers alone keeps the defaults'
    toy-digits prompts): refused, naming the card's own task."""
    card = cfg.model.card
    if card not in TOY_TASKS:
        return
    for key in ("data.prompts", "data.eval_prompts"):
        owner = TOY_DATASET_CARDS.get(config_value(cfg, key))
        if owner is not None and owner != card:
            checks.fail(f"{key}={config_value(cfg, key)} is the {owner} card's task, but model.card={card}; "
                        f"for {card} set {TOY_TASKS[card]}, or give prompts of your own")


def check_data(cfg, checks: ConfigChecks) -> None:
    """`data`: the batch shape, and both datasets load (with an image per row exactly for image-conditioned
    cards)."""
    checks.require("data.prompts_per_step", lambda v: v >= 1, POSITIVE)
    checks.require("data.group_size", lambda v: v >= 2, "must be >= 2: advantages compare the samples of a group")
    check_toy_task(cfg, checks)
    for key in ("data.prompts", "data.eval_prompts"):
        try:
            items = load_prompts(config_value(cfg, key))
        except (OSError, ValueError) as e:
            checks.fail(f"{key}={config_value(cfg, key)!r}: {e}")
        else:
            check_dataset_images(cfg, key, items, checks)
            check_reward_prompts(cfg, key, items, checks)
            if key == "data.eval_prompts":
                check_judge_prompts(cfg, items, checks)
            if key == "data.prompts":
                warn_prompts_per_step(cfg, len(items))


def check_ode_ignores_noise(cfg, checks: ConfigChecks) -> None:
    """The noise keys sampler=ode would ignore, when set (noise_level: when it is not the default, the one
    value a config can hold without saying anything)."""
    fix = "use sampler=sde or cps, or leave the key out"
    default = {f.name: f.default for f in dataclasses.fields(cfg.sampling)}["noise_level"]  # the recipe's own
    if cfg.sampling.noise_level != default:
        checks.fail(f"sampling.noise_level={cfg.sampling.noise_level} with sampling.sampler=ode: the ODE draws no "
                    f"noise, so it would be ignored; {fix}")
    if cfg.sampling.sde_window is not None:
        checks.fail(f"sampling.sde_window={list(cfg.sampling.sde_window)} with sampling.sampler=ode: the ODE has no "
                    f"stochastic steps, so it would be ignored; {fix}")
    if cfg.sampling.audio_noise_level is not None:
        checks.fail(f"sampling.audio_noise_level={cfg.sampling.audio_noise_level} with sampling.sampler=ode: the "
                    f"ODE draws no noise, so it would be ignored; {fix}")


def check_advantage_unused(cfg, checks: ConfigChecks, recipe: str, why: str) -> None:
    """`advantage.*` in a recipe that trains on no advantages (DPO ranks by the reward, DRaFT takes its
    gradient): a key set away from the shared section's default would be ignored, so it is refused."""
    keys = [f"advantage.{field.name}" for field in dataclasses.fields(cfg.advantage)]
    for key, value in set_away_from_default(cfg, keys):
        checks.fail(f"{key}={value}: {recipe} trains on no advantages ({why}), so it would be ignored; leave it out")


def check_sampling(cfg, checks: ConfigChecks) -> None:
    """`sampling`: the rollouts' sampler, its noise, guidance, schedule, window, size and audio."""
    checks.require("sampling.steps", lambda v: v >= 1, POSITIVE)
    for key in ("sampling.height", "sampling.width", "sampling.frames"):
        checks.require(key, lambda v: v >= 1, POSITIVE + " or null", allow_none=True)
    sampler = cfg.sampling.sampler
    if sampler == "cps":
        checks.require("sampling.noise_level", lambda v: 0 < v < 1, "is CPS's eta for sampler=cps: in (0, 1)")
    elif sampler == "sde":
        checks.require("sampling.noise_level", lambda v: 0 < v <= 10, "is Flow-SDE's a: in (0, 10] (0 is the ODE)")
    if sampler == "ode":
        check_ode_ignores_noise(cfg, checks)
    if cfg.sampling.same_noise_per_group and sampler == "ode":
        checks.fail("sampling.same_noise_per_group=true with sampling.sampler=ode: every sample of a group would "
                    "be the same image (no reward spread, nothing to train on); use sampler=sde or cps, or set "
                    "same_noise_per_group=false")
    checks.require("sampling.guidance_scale", lambda v: 0 <= v <= 100, "must be in [0, 100] (1 = no guidance)")
    check_rollout_cache_keys(cfg, checks)
    checks.require("sampling.time_shift", lambda v: 0 < v <= 100, "must be in (0, 100] (1 = no shift)")
    checks.require("sampling.sde_window", lambda w: 0 <= w[0] < w[1] <= cfg.sampling.steps,
                   f"must be [start, end) with 0 <= start < end <= sampling.steps ({cfg.sampling.steps})",
                   allow_none=True)
    check_audio_keys(cfg, checks)


def check_optimizer(cfg, checks: ConfigChecks) -> None:
    """The optimizer and batching keys every recipe's `train` section has (OptimConfig); the recipe checks
    the rest of its section."""
    for key in ("train.minibatch_size", "train.gradient_accumulation_steps"):
        checks.require(key, lambda v: v >= 1, POSITIVE)
    checks.require("train.updates_per_rollout", lambda v: v >= 1, POSITIVE + " or null", allow_none=True)
    checks.require("train.learning_rate", lambda v: 0 < v <= 1, "must be in (0, 1]")
    checks.require("train.weight_decay", lambda v: v >= 0, "must be >= 0")
    check_decay_per_step(cfg, checks)
    checks.require("train.adam_betas", lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                   "must be two numbers in [0, 1)")
    checks.require("train.max_grad_norm", lambda v: v > 0, "must be > 0")
    check_minibatches(cfg, checks)


# AdamW multiplies every weight by 1 - lr·weight_decay each step, whatever the gradient. Usual settings make that a
# few parts in a million (1e-4 at lr 6e-4 here, 0.1 at 3e-4 for LLMs); a hundredth a step halves an unpulled
# weight in 70 steps.
DECAY_WARN_PER_STEP = 0.01


def check_decay_per_step(cfg, checks: ConfigChecks) -> None:
    """lr·weight_decay, the share of every weight AdamW's decay takes a step: refused at 1 or more (each step
    would zero the weights, or flip their sign), warned about from DECAY_WARN_PER_STEP."""
    lr, wd = cfg.train.learning_rate, cfg.train.weight_decay
    if not (isinstance(lr, (int, float)) and isinstance(wd, (int, float)) and 0 < lr <= 1 and 0 <= wd < math.inf):
        return  # the bounds of each are reported by their own checks
    share = lr * wd
    if share >= 1:
        checks.fail(f"train.weight_decay={wd:g}: AdamW multiplies every weight by 1 - learning_rate x weight_decay "
                    f"= {1 - share:.3g} each step (train.learning_rate={lr:g}), so each step would "
                    f"{'zero the weights' if share == 1 else 'flip their sign'}; it must be under {1 / lr:.4g} at "
                    f"this rate (the shipped configs use 1e-4)")
    elif share >= DECAY_WARN_PER_STEP:
        warn(f"train.weight_decay={wd:g} with train.learning_rate={lr:g}: AdamW's decay takes {share:.1%} of every "
             f"weight each step, whatever the gradient (the shipped configs' 1e-4 takes under 0.0001%); a weight "
             f"the gradient does not hold up halves in {math.log(0.5) / math.log(1 - share):.0f} steps")


def check_reward(cfg, checks: ConfigChecks) -> None:
    """`reward`: the scorers' spec, arguments and modules (by name: rewards.registry.check_spec), the bounds of
    remote scorers and the masked-steps stop."""
    from rewards.remote import MAX_SECONDS

    for key in ("reward.timeout_s", "reward.budget_s"):
        checks.require(key, lambda v: 0 < v <= MAX_SECONDS, f"must be a number of seconds in (0, {MAX_SECONDS}] "
                       "(a week)")
    checks.require("reward.max_masked_steps", lambda v: v >= 1, POSITIVE)
    checks.require("reward.max_flat_steps", lambda v: v >= 1, POSITIVE)
    check_reward_keys(cfg, checks)


def check_advantage(cfg, checks: ConfigChecks) -> None:
    """`advantage`: the clip, and a normalisation that does something with the reward's aggregation."""
    checks.require("advantage.clip_max", lambda v: v > 0, "must be > 0")
    if cfg.reward.aggregation == "gdpo" and cfg.advantage.global_std:
        checks.fail("advantage.global_std=true does nothing with reward.aggregation=gdpo, which normalises over "
                    "the batch already: set one of them")
    if cfg.reward.aggregation != "weighted_sum":
        try:
            scorers = parse_spec_targets(cfg.reward.scorers)
        except (TypeError, ValueError):
            return  # check_reward names it
        if len(scorers) == 1:
            # One scorer: its group advantages, scaled by its weight (sum_of_advantages) or by the batch's std
            # (gdpo), point where weighted_sum's do; AdamW's step does not see a constant scale.
            warn(f"reward.aggregation={cfg.reward.aggregation} with one scorer ({cfg.reward.scorers}): it combines "
                 "several scorers' advantages, and with one gives weighted_sum's up to a scale, which AdamW's step "
                 "does not see; name two or more scorers, or leave it out")


def check_ema(cfg, checks: ConfigChecks) -> None:
    """`ema`: the decay and the schedule of its moves."""
    checks.require("ema.decay", lambda v: 0 <= v < 1,
                   "must be in [0, 1) (EMA <- decay·EMA + (1 - decay)·weights; 0 = the trained weights)")
    checks.require("ema.start_step", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("ema.update_every", lambda v: v >= 1, POSITIVE)
    ec = cfg.ema
    if ec.enabled and not cfg.resume and ec.start_step >= 0 and ec.update_every >= 1 and cfg.steps >= 1:
        from flywheel.recipe.ema import first_ema_move

        if first_ema_move(ec) > cfg.steps:
            # A warning, not a refusal: a short smoke run of a shipped config (sd3_pickscore's EMA moves every 8
            # steps) is legitimate; the run says so again at its end.
            warn(f"ema.update_every={ec.update_every} with ema.start_step={ec.start_step} and steps={cfg.steps}: "
                 f"the EMA average will never move, so every evaluation"
                 f"{' (and lora_ema/)' if cfg.model.finetune == 'lora' else ''} will be the weights the run "
                 f"starts from; set ema.update_every <= {cfg.steps} or ema.start_step >= 1 to evaluate training")


def check_eval(cfg, checks: ConfigChecks) -> None:
    """`eval`: cadence, samples, guidance, the adaptive loop, judges and the hacking stop."""
    for key in ("eval.every", "eval.seeds"):
        checks.require(key, lambda v: v >= 1, POSITIVE)
    checks.require("eval.steps", lambda v: v >= 1, POSITIVE + " or null", allow_none=True)
    checks.require("eval.guidance_scale", lambda v: 0 <= v <= 100, "must be in [0, 100] (1 = no guidance)")
    checks.require("eval.cache_threshold", lambda v: 0 <= v <= 1,
                   "must be in [0, 1] (0 = the plain loop; the toy eval keeps its reward within 0.01 at 0.15)")
    checks.require("eval.stop_on_hacking", lambda v: v >= 0, "must be an integer >= 0 (0 = off)")
    entries = [n.strip() for n in cfg.eval.judges.split(",")] if cfg.eval.judges.strip() else []
    if "" in entries:
        checks.fail(f"eval.judges={cfg.eval.judges!r}: entry {entries.index('') + 1} is empty; give scorer names "
                    "separated by commas (or leave it empty for the card's own judges alone)")
    twice = sorted({n for n in entries if n and entries.count(n) > 1})
    if twice:
        checks.fail(f"eval.judges={cfg.eval.judges!r} names {', '.join(twice)} more than once; name each judge once")
    trained = _trained_scorer_names(cfg)
    for name in judge_names(cfg.eval.judges):
        from rewards.registry import available, check_scorer

        if name not in available():
            from rewards.judges import judges_for_card

            builtin = judges_for_card(cfg.model.card) if cfg.model.card in list_cards() else {}
            own = (f"; {', '.join(builtin)} {'is' if len(builtin) == 1 else 'are'} the {cfg.model.card} card's own "
                   "judges, which every evaluation runs already" if name in builtin else "")
            checks.fail(f"eval.judges names {name!r}, which is not a registered scorer{own}; known: "
                        f"{', '.join(available())}")
            continue
        if name in trained:
            warn(f"eval.judges names {name}, which reward.scorers trains on: a judge is meant to be independent "
                 "of the reward, and the hacking watch would compare the reward with itself; name a scorer the "
                 "run does not train on")
        try:  # its folder or address (judges are built from the environment alone: no arguments)
            check_scorer(name)
        except (ValueError, OSError) as e:
            checks.fail(f"eval.judges={cfg.eval.judges!r}: {name}: {e}")


def judge_names(spec: str) -> list[str]:
    """The scorer names of an eval.judges value, each once, in order (empty entries dropped: check_eval refuses
    them)."""
    return list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))


def _trained_scorer_names(cfg) -> set[str]:
    """The registry names reward.scorers trains on (none when the spec does not parse: check_reward_keys says)."""
    try:
        return {target for _, target, _ in parse_spec_targets(cfg.reward.scorers)}
    except ValueError:
        return set()


def check_rollout(cfg, checks: ConfigChecks) -> None:
    """`rollout`: the keys its own __post_init__ does not check (the layout's and Ray's are checked there, as
    the section is built)."""
    checks.require("rollout.max_staleness", lambda v: v >= 0, "must be an integer >= 0")
    for key in OUT_OF_PROCESS_KEYS:
        checks.require(key, lambda v: 0 < v < math.inf, "must be a finite number of seconds > 0")
    world = launch_world_size()
    if cfg.rollout.asynchronous and world > 1:
        # The engine process takes the cores the other trainer processes would use (EngineProcess.build).
        checks.fail(f"rollout.asynchronous=true needs a single trainer process (the engine process takes the "
                    f"other cores); this launch has {world}: launch one process, or set rollout.asynchronous=false")
    elif cfg.rollout.asynchronous and fsdp_requested():
        # The engine process's shared buffer takes over the trained parameters, which FSDP holds as views.
        checks.fail("rollout.asynchronous=true with an FSDP launch: the engine process shares the trained "
                    "parameters' memory, which FSDP owns; launch without the FSDP config, or set "
                    "rollout.asynchronous=false")
    if cfg.rollout.backend == "ray":
        from flywheel.scale.config import ray_launch_problems

        for problem in ray_launch_problems(cfg.rollout, world):
            checks.fail(problem)


def check_workflow(cfg, checks: ConfigChecks) -> None:
    """`workflow`: name is a registered workflow and stage its first card stage on model.card; neither key
    without the other; no engine process (its stages run in this one)."""
    from engine.workflows import default_registry, stage_paths

    wf = cfg.workflow
    workflow_id, stage = wf.name, wf.stage
    if workflow_id is None:
        if stage is not None:
            checks.fail(f"workflow.stage={stage!r} names a stage of a workflow, but workflow.name is null; set "
                        f"workflow.name to one of: {', '.join(default_registry().ids())}")
        if wf.paths:
            checks.fail("workflow.paths is set but workflow.name is null: it gives the folders of a "
                        "workflow's other cards")
        return
    registry = default_registry()
    try:
        paths = stage_paths(registry, workflow_id)
    except (KeyError, ValueError) as e:
        checks.fail(f"workflow.name={workflow_id!r}: {str(e).strip(chr(34))}")
        return
    if stage not in paths:
        checks.fail(f"workflow.stage={stage!r}: name the stage of {workflow_id!r} to train; its card stages, in "
                    f"the order they run: {', '.join(f'{p} ({c})' for p, c in paths.items())}")
        return
    first = next(iter(paths))
    if stage != first:
        checks.fail(f"workflow.stage={stage!r}: only the first stage to run ({first!r}) can be trained; a later "
                    f"stage starts from another stage's output, which the trainer does not regenerate")
    if paths[stage] != cfg.model.card:
        checks.fail(f"model.card={cfg.model.card!r}: stage {stage!r} of {workflow_id!r} runs card "
                    f"{paths[stage]!r}; set model.card={paths[stage]}")
    unknown = sorted(set(wf.paths) - set(paths.values()))
    if unknown:
        checks.fail(f"workflow.paths names card(s) {', '.join(unknown)} that {workflow_id!r} does not run; "
                    f"its cards: {', '.join(sorted(set(paths.values())))}")
    if cfg.model.card in wf.paths:
        checks.fail(f"workflow.paths.{cfg.model.card}={wf.paths[cfg.model.card]!r}: {cfg.model.card!r} is the "
                    "trained card, whose folder is model.path (every stage on it uses that one); move the folder "
                    "to model.path and leave this entry out")
    check_workflow_steps(cfg, checks, registry)


def check_workflow_steps(cfg, checks: ConfigChecks, registry) -> None:
    """Each image-to-image stage can start part-way through the steps it runs with (the stage's own `steps`
    override, else sampling.steps for rollouts and eval.steps for evaluations): said here rather than by the
    step-0 evaluation, after the run dir is written."""
    from engine.workflows import FromImage, WorkflowError, stage_plan

    counts = {"sampling.steps": cfg.sampling.steps}
    if cfg.eval.steps is not None:
        counts["eval.steps"] = cfg.eval.steps
    for path, stage in stage_plan(registry, cfg.workflow.name).items():
        if not isinstance(stage.input, FromImage):
            continue
        for key, steps in counts.items():
            steps = stage.overrides.get("steps", steps)
            try:
                stage.input.start_step(steps)
            except WorkflowError as e:
                where = f"stage {path!r}'s steps override" if "steps" in stage.overrides else f"{key}={counts[key]}"
                checks.fail(f"{where}: stage {path!r} of {cfg.workflow.name!r}: {e}")
                break


def check_environment(cfg, checks: ConfigChecks) -> None:
    """What needs more than the config's values, still before anything is written: the run dir is usable, the
    model folder is the card's, the scorers' folders are there and remote reward servers answer."""
    check_run_dir(cfg, checks)
    check_model_path(cfg, checks)
    check_workflow_paths(cfg, checks)
    check_ray_address(cfg, checks)
    check_rewards(cfg, checks)
    check_judge_servers(cfg, checks)


def card_flag(card: str, name: str) -> bool:
    """A card's boolean default (`audio`, `image_conditioned`, `video`); False for an unknown card, which the
    card check reports."""
    try:
        return bool(get_card(card).defaults.get(name, False))
    except KeyError:
        return False


def check_dataset_images(cfg, key: str, items, checks: ConfigChecks) -> None:
    """An image-conditioned card (image-to-video) needs an "image" in every row of its datasets, and no other
    card takes one: refused here, before a model of many GB is loaded for the first generate to fail."""
    conditioned = card_flag(cfg.model.card, "image_conditioned")
    rows = [i + 1 for i, item in enumerate(items) if ("image" in item.metadata) != conditioned]
    if not rows:
        if conditioned:
            check_images_readable(key, items, checks)
        return
    shown = listed_rows(rows)
    if conditioned:
        checks.fail(f"{key}={config_value(cfg, key)!r}: card {cfg.model.card!r} is conditioned on an image per prompt "
                    f"(a first frame, or the source image of an edit), but "
                    f"prompt(s) {shown} have none: use a .jsonl whose rows are "
                    f"{{\"prompt\": ..., \"image\": \"path.png\"}}")
    else:
        checks.fail(f"{key}={config_value(cfg, key)!r}: prompt(s) {shown} name an \"image\" but card "
                    f"{cfg.model.card!r} takes none; only image-conditioned cards (image-to-video, editing) do")


def listed_rows(rows: list[int]) -> str:
    """Row numbers for a message: the first ten, then how many more."""
    return ", ".join(map(str, rows[:10])) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")


def check_reward_prompts(cfg, key: str, items, checks: ConfigChecks) -> None:
    """Each scorer that says which prompts it can score (`rewards.registry.prompt_coverage`: the digit, number
    and OCR rewards, in-process or behind a `remote:` server's POST /coverage) scores some of the dataset at
    `key`. One that scores none would mask every sample: training stops after reward.max_masked_steps, an
    evaluation is NaN at the end of the run. Prompts it cannot score (their samples are masked) are named in a
    warning."""
    try:
        entries = parse_spec_targets(cfg.reward.scorers)
    except ValueError:
        return  # check_reward_keys reports the spec
    prompts, metadata = [item.prompt for item in items], [item.metadata for item in items]
    value = config_value(cfg, key)
    for name, target, _ in entries:
        try:
            if target.startswith(REMOTE):  # the server's word (POST /coverage), when its reward gives one
                coverage = remote_prompt_coverage(cfg, name, target, prompts, metadata)
            else:
                coverage = prompt_coverage(target, prompts, metadata)
        except (KeyError, ImportError):
            continue  # an unknown scorer, or one whose module fails to import: the reward checks name it
        except ValueError as e:
            checks.fail(f"{key}={value!r}: reward {name}: {e}")
            continue
        if coverage is None:
            continue
        scored, needs = coverage
        missing = [row + 1 for row, ok in enumerate(scored) if not ok]
        if not missing:
            continue
        if len(missing) == len(items):
            checks.fail(f"{key}={value!r}: reward {name} can score none of its {len(items)} prompt(s), so every "
                        f"sample would be masked; each prompt needs {needs} (prompt 1 is {prompts[0]!r})")
        else:
            shown = listed_rows(missing)
            warn(f"{key}={value!r}: reward {name} cannot score prompt(s) {shown} of {len(items)}, whose samples it "
                 f"masks; each needs {needs}")


def check_judge_prompts(cfg, items, checks: ConfigChecks) -> None:
    """Each of eval.judges that says which prompts it can score scores every evaluation prompt that has a class
    (the card's judges give the toy tasks' classes: a judge must score every sample of a class, or the
    evaluation stops), and at least one of the others; prompts it cannot score are named in a warning. Before,
    `eval.judges=ocr` on the digit prompts ran until the first evaluation failed, after the run dir was made."""
    if not judge_names(cfg.eval.judges):
        return
    from flywheel.rollout_collector import eval_classes
    from rewards.judges import judges_for_card  # scikit-learn's import: only for a config that names judges

    prompts, metadata = [item.prompt for item in items], [item.metadata for item in items]
    try:
        classes = eval_classes(judges_for_card(cfg.model.card), prompts, metadata)
    except (KeyError, ValueError):
        return  # an unknown card, or prompts the card's judges refuse: reported with the card and the data
    key, value = "data.eval_prompts", config_value(cfg, "data.eval_prompts")
    for name in judge_names(cfg.eval.judges):
        try:
            coverage = prompt_coverage(name, prompts, metadata)
        except (KeyError, ImportError, ValueError):
            continue  # an unknown judge (check_eval names it), or a row it refuses (its own error at scoring)
        if coverage is None:
            continue
        scored, needs = coverage
        missing = [row for row, ok in enumerate(scored) if not ok]
        classed = [row for row in missing if classes is not None and classes[row] is not None]
        if classed or len(missing) == len(items):
            rows = classed or missing
            shown = listed_rows([r + 1 for r in rows])
            why = (f"that have a class (a judge must score every sample of a class: the {cfg.model.card} card's "
                   "judges give the classes)" if classed else f"of {len(items)}: it would score no sample")
            checks.fail(f"eval.judges={cfg.eval.judges!r}: judge {name} cannot score prompt(s) {shown} of {key}="
                        f"{value!r}, {why}; each needs {needs}")
        elif missing:
            warn(f"eval.judges={cfg.eval.judges!r}: judge {name} cannot score {len(missing)} of the {len(items)} "
                 f"prompt(s) of {key}={value!r}; each needs {needs}")


def check_images_readable(key: str, items, checks: ConfigChecks) -> None:
    """Every row's image is a file PIL can read as an image (its header only: cheap for a large dataset), so a
    corrupt or mislabelled file is named by its row here rather than failing a rollout after the model loads."""
    from PIL import Image

    bad, verdict = [], {}
    for i, item in enumerate(items):
        path = item.metadata["image"]
        if path not in verdict:
            try:
                with Image.open(path) as image:
                    image.size  # noqa: B018  (the header is parsed by open; size proves it was)
                verdict[path] = None
            except (OSError, ValueError) as e:
                verdict[path] = type(e).__name__
        if verdict[path] is not None:
            bad.append(f"row {i + 1}: {path!r}")
    if bad:
        more = f"; and {len(bad) - 10} more" if len(bad) > 10 else ""
        checks.fail(f"{key}: {len(bad)} image(s) cannot be read as images: {'; '.join(bad[:10])}{more}")


def check_audio_keys(cfg, checks: ConfigChecks) -> None:
    """sampling.audio only on a card that generates sound; its own guidance and noise level only with it."""
    sampling = cfg.sampling
    if sampling.audio and cfg.model.card in list_cards() and not card_flag(cfg.model.card, "audio"):
        checks.fail(f"sampling.audio=true: card {cfg.model.card!r} generates no sound; joint audio+video cards: "
                    f"{', '.join(c for c in list_cards() if card_flag(c, 'audio'))}")
    for key in ("sampling.audio_guidance_scale", "sampling.audio_noise_level"):
        if config_value(cfg, key) is not None and not sampling.audio:
            checks.fail(f"{key}={config_value(cfg, key)} is set but sampling.audio=false: it applies to the audio "
                        f"only; set sampling.audio=true or {key}=null")
    checks.require("sampling.audio_guidance_scale", lambda v: 0 <= v <= 100, "must be in [0, 100] or null",
                   allow_none=True)
    checks.require("sampling.audio_noise_level", lambda v: 0 <= v <= 10,
                   "must be in [0, 10] or null (0 = deterministic audio steps)", allow_none=True)


def check_rollout_cache_keys(cfg, checks) -> None:
    """sampling.cache_threshold / early_exit: in range, and on steps the adaptive loop may skip. A stochastic
    rollout may skip only the ODE steps after its SDE window; a recipe that places the windows itself (GRPO's
    mixgrpo and fast variants) turns the cache off for a window that reaches the last step."""
    sampling = cfg.sampling
    checks.require("sampling.cache_threshold", lambda v: 0 <= v <= 1,
                   "must be in [0, 1] (0 = the plain loop; the toy eval keeps its reward within 0.01 at 0.15)")
    checks.require("sampling.early_exit", lambda v: 0 < v <= 1,
                   "must be in (0, 1] (the predicted image's relative change still to come), or null for none",
                   allow_none=True)
    adaptive = sampling.cache_threshold > 0 or sampling.early_exit is not None
    places_windows = getattr(cfg.train, "variant", "flow_grpo") != "flow_grpo"
    window_end = sampling.sde_window[1] if sampling.sde_window is not None else sampling.steps
    if adaptive and sampling.sampler != "ode" and not places_windows and window_end >= sampling.steps:
        checks.fail(f"sampling.cache_threshold / early_exit with sampling.sampler={sampling.sampler} and "
                    f"sampling.sde_window={None if sampling.sde_window is None else list(sampling.sde_window)}: a "
                    "stochastic rollout skips model calls only on the ODE steps after its SDE window (a trained "
                    "step's log-prob needs its own call), and this window leaves none; set an sde_window ending "
                    "before sampling.steps, sampler=ode (recipes that train no per-step log-probs: nft, awm, dpo), "
                    "or cache_threshold=0 and early_exit=null")
