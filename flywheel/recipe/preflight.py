"""The checks that look beyond the config's own values, every one before the run directory is written.

`check_shared_sections` runs the config-time ones (nothing loaded): the run
directory is usable, the reward spec names known scorers with finite weights,
their local folders exist and every `remote:` server answers its /health
within a few seconds; the model folder is a diffusers folder of the card's
family; the step counts are within bounds and `train.updates_per_rollout`
divides the minibatches of a step. `check_built_model` runs the ones that need
the model (`build_policy`, before `RecipeRun.resume` creates the run
directory): the LoRA targets match modules of the transformer, and the
requested size and frames fit the card's rules. Each failure is one line
naming the key (a ConfigError: exit 2, see flywheel/cli.py).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.card_folders import check_card_path
from engine.types import MAX_FRAMES, MAX_SIZE, MAX_STEPS
from flywheel.config.parsing import ConfigError
from flywheel.runs.rundir import RunDir, RunDirInUseError
from rewards.registry import REMOTE, available, check_scorer, check_spec, get, parse_spec_targets, resolve_args

if TYPE_CHECKING:
    from flywheel.config.validation import ConfigChecks

# A bound on `steps` that no real run reaches (1e7 steps of one second each is four months): a typo such as
# steps=1e12 is refused instead of starting a run whose progress bar and schedules are meaningless.
MAX_TRAINING_STEPS = 10_000_000
# Rollouts a step (data.prompts_per_step x data.group_size): a step holds all of them at once. Published runs
# take about a thousand; the bound is there so that a typo (1e30) is refused rather than planned for.
MAX_ROWS_PER_STEP = 1_000_000
MAX_EVAL_SEEDS = 10_000  # samples of each evaluation prompt, every evaluation
# The run seed: numpy's and torch's generators take it, and it is mixed into 64-bit seeds with the step
# (seed x 7919 + step in GRPO's step choice), which a seed over 2**32 could overflow.
MAX_SEED = 2**32 - 1
MAX_THREADS = 1024  # torch.set_num_threads takes a C int; far over any machine's cores
MAX_REWARD_ACTORS = 1024  # Ray actors, each holding its own reward model
# Wall-clock bound (s) of the /health probe of each remote: reward at config time.
REMOTE_PROBE_S = 5.0


def warn(message: str) -> None:
    """A config warning on stderr, before any work; once per launch (the first process prints it)."""
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Config time: nothing loaded
# ---------------------------------------------------------------------------------------


def check_bounds(cfg, checks: ConfigChecks) -> None:
    """`steps`, the denoising steps, the seed, threads and the samples of a step or an evaluation within what the
    trainer, the engine and torch take."""
    checks.require("steps", lambda v: v <= MAX_TRAINING_STEPS,
                   f"must be at most {MAX_TRAINING_STEPS:,} training steps".replace(",", "_"))
    for key in ("sampling.steps", "eval.steps"):
        checks.require(key, lambda v: v <= MAX_STEPS, f"must be at most {MAX_STEPS} (the engine's bound on "
                       "denoising steps)", allow_none=True)
    checks.require("seed", lambda v: v <= MAX_SEED, f"must be at most 2**32 - 1 = {MAX_SEED}")
    checks.require("threads", lambda v: v <= MAX_THREADS, f"must be at most {MAX_THREADS} torch threads",
                   allow_none=True)
    for key, bound in (("sampling.height", MAX_SIZE), ("sampling.width", MAX_SIZE), ("sampling.frames", MAX_FRAMES)):
        checks.require(key, lambda v, bound=bound: v <= bound, f"must be at most {bound} (the engine's bound)",
                       allow_none=True)
    checks.require("rollout.reward_actors", lambda v: v <= MAX_REWARD_ACTORS, f"must be at most {MAX_REWARD_ACTORS}")
    checks.require("eval.seeds", lambda v: v <= MAX_EVAL_SEEDS,
                   f"must be at most {MAX_EVAL_SEEDS:,} samples of each evaluation prompt".replace(",", "_"))
    rows = _rows_per_step(cfg)
    if rows is not None and rows > MAX_ROWS_PER_STEP:
        checks.fail(f"data.prompts_per_step x data.group_size = {cfg.data.prompts_per_step} x "
                    f"{cfg.data.group_size} = {rows} rollouts a step: must be at most "
                    f"{MAX_ROWS_PER_STEP:,}".replace(",", "_"))


def _rows_per_step(cfg) -> int | None:
    """data.prompts_per_step x data.group_size; None when either is not a positive integer (the range checks
    report it)."""
    data = cfg.data
    if not (_positive_int(data.prompts_per_step) and _positive_int(data.group_size)):
        return None
    return data.prompts_per_step * data.group_size


def _divisors(n: int) -> str:
    """n's divisors in order, comma-separated (n <= MAX_ROWS_PER_STEP: a square root's worth of trials)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return ", ".join(str(d) for d in low + [n // d for d in reversed(low) if d * d != n])


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def launch_world_size() -> int:
    """The launcher's process count (accelerate and torchrun set WORLD_SIZE; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def fsdp_requested() -> bool:
    """Whether `accelerate launch` was given an FSDP config (it sets ACCELERATE_USE_FSDP): known before the
    Accelerator exists, for the checks before work."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def optimizer_steps_per_update(cfg, world: int | None = None) -> int | None:
    """Optimizer steps one update takes on each process: train.updates_per_rollout, else that process's
    minibatches over train.gradient_accumulation_steps, on `world` processes (default: the launcher's); None when
    a size is not a positive integer (the range checks report it; a split that does not divide is
    check_minibatches')."""
    tc, data = cfg.train, cfg.data
    if tc.updates_per_rollout is not None:
        return tc.updates_per_rollout
    sizes = (data.prompts_per_step, data.group_size, tc.minibatch_size, tc.gradient_accumulation_steps)
    if not all(_positive_int(v) for v in sizes):
        return None
    world = launch_world_size() if world is None else max(1, world)
    minibatches = math.ceil(data.prompts_per_step * data.group_size // world / tc.minibatch_size)
    return max(1, minibatches // tc.gradient_accumulation_steps)


def check_anchor_lags(cfg, checks) -> None:
    """An EMA anchor (train.anchor_beta > 0, DRaFT and AWM) whose decay is 0 at every step, train.anchor_decay 0
    or train.anchor_decay_ramp 0, is reset to the trained weights after each step. With one optimizer step a
    step, every loss term then sees the anchor equal to the weights it trains: the term and its gradient are
    exactly 0 and the anchor does nothing. Refused (a resume is left alone: its keys passed at the start)."""
    tc = cfg.train
    if cfg.resume or not tc.anchor_beta > 0 or optimizer_steps_per_update(cfg) != 1:
        return
    for key in ("train.anchor_decay", "train.anchor_decay_ramp"):
        if getattr(tc, key.removeprefix("train.")) == 0:
            checks.fail(f"{key}=0 with train.anchor_beta={tc.anchor_beta:g} and one optimizer step a rollout: the "
                        f"anchor's decay is 0 at every step, so it is reset to the trained weights after each and "
                        f"its term is exactly 0; give {key} a value > 0, or set train.anchor_beta=0")


def check_minibatches(cfg, checks: ConfigChecks) -> None:
    """The rows of a step split into whole minibatches and optimizer steps on every process: what
    `flywheel.recipe.update.accumulation_steps` would refuse at the first update."""
    tc = cfg.train
    rows = _rows_per_step(cfg)
    if rows is None or rows > MAX_ROWS_PER_STEP or not _positive_int(tc.minibatch_size):
        return  # reported by the range checks and check_bounds
    world = launch_world_size()
    if rows % world:
        checks.fail(f"data.prompts_per_step x data.group_size = {rows} rows must be divisible by the number of "
                    f"processes ({world}): each process rolls out an equal share")
        return
    local = rows // world
    n = math.ceil(local / tc.minibatch_size)
    where = (f"the {n} minibatch{'es' if n != 1 else ''} of a step ({local} rows"
             f"{f' on each of {world} processes' if world > 1 else ''} in train.minibatch_size={tc.minibatch_size})")
    upr = tc.updates_per_rollout
    if getattr(tc, "MINIBATCH_UNIT", "rows") == "rows" and local % tc.minibatch_size and tc.minibatch_size < local:
        # A short last minibatch would take an optimizer step on a few rows, or weigh its rows more than the
        # others' under accumulation (each minibatch's loss is its rows' mean): refused, as the public codes do.
        fits = _divisors(local)
        checks.fail(f"train.minibatch_size={tc.minibatch_size} does not divide the {local} rows of a step"
                    f"{f' on each of {world} processes' if world > 1 else ''} (data.prompts_per_step x "
                    f"data.group_size{f' / {world}' if world > 1 else ''}): the last minibatch would hold "
                    f"{local % tc.minibatch_size}; use one of {fits}")
    elif _positive_int(upr) and n % upr:
        checks.fail(f"train.updates_per_rollout={upr} does not divide {where}: use one of {_divisors(n)} (or null), "
                    "or change train.minibatch_size")
    elif upr is None and _positive_int(tc.gradient_accumulation_steps) and n % tc.gradient_accumulation_steps:
        checks.fail(f"train.gradient_accumulation_steps={tc.gradient_accumulation_steps} does not divide {where}: "
                    f"use one of {_divisors(n)}, or change train.minibatch_size")


def warn_prompts_per_step(cfg, prompts: int) -> None:
    """More distinct prompts per step than the dataset holds: the step repeats some (allowed, said)."""
    per_step = cfg.data.prompts_per_step
    if _positive_int(per_step) and per_step > prompts:
        warn(f"data.prompts_per_step={per_step} is more than the {prompts} prompt(s) of "
             f"data.prompts={cfg.data.prompts!r}: each step repeats prompts (groups of the same prompt are "
             f"normalised apart); lower data.prompts_per_step to at most {prompts} for distinct prompts")


def warn_split_groups(cfg, consequence: str, world: int | None = None) -> None:
    """Say so, before work, when the launch splits groups across processes (a process rolls out the rows
    [r·n, (r+1)·n), so a group spans two when n is not a multiple of the group size) and the recipe works on
    a process's share of a group alone: `consequence` says what that changes. Allowed: advantages are computed
    over whole groups (every process gathers the rewards), only the recipe's own per-group choice is local."""
    world = launch_world_size() if world is None else world
    size, per_step = cfg.data.group_size, cfg.data.prompts_per_step
    if world <= 1 or not (_positive_int(size) and _positive_int(per_step)) or (size * per_step) % world:
        return  # one process, or rows the processes do not divide (refused by check_minibatches)
    rows = size * per_step // world
    if rows % size:
        warn(f"data.group_size={size} on {world} processes of {rows} rows each: groups are split across "
             f"processes, and {consequence}; use a group size that divides each process's rows")


def check_run_dir(cfg, checks: ConfigChecks) -> None:
    """`run_dir` is (or can become) a writable directory: probed with a temporary folder that is removed, so
    the run directory itself is not created here."""
    path = Path(str(cfg.run_dir)).expanduser()
    if not str(cfg.run_dir).strip():
        checks.fail("run_dir='': give the directory the run writes (config, metrics, samples, checkpoints)")
        return
    if path.exists() and not path.is_dir():
        checks.fail(f"run_dir={str(cfg.run_dir)!r} is a file, not a directory: choose another run_dir")
        return
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        checks.fail(f"run_dir={str(cfg.run_dir)!r}: {existing} is a file, so no directory can be made there")
        return
    try:
        probe = tempfile.mkdtemp(prefix=".flywheel-probe-", dir=existing)
    except OSError as e:
        checks.fail(f"run_dir={str(cfg.run_dir)!r} is not usable: cannot create a directory in {existing} "
                    f"({e.strerror or e}); choose a writable run_dir")
        return
    os.rmdir(probe)
    if not cfg.resume and not cfg.overwrite and path.is_dir():
        # A used run dir is refused now, not after the model has loaded (RecipeRun.resume creates the dir);
        # the refusal is RunDir's own, asked of a RunDir that creates nothing (not the main process).
        try:
            RunDir(path, mode="new", is_main_process=False).refuse_if_used()
        except RunDirInUseError as e:
            checks.fail(f"run_dir={str(cfg.run_dir)!r}: {e}")
    elif not cfg.resume and cfg.overwrite and path.is_dir():
        try:  # refused at RunDir's clearing too, but only once the model has loaded
            RunDir(path, mode="new", is_main_process=False).refuse_overwrite_of_other_files()
        except RunDirInUseError as e:
            checks.fail(f"run_dir={str(cfg.run_dir)!r}: {e}")


def check_reward_keys(cfg, checks: ConfigChecks) -> None:
    """The reward keys by themselves (`rewards.registry.check_spec`: modules, the spec's syntax and weights,
    known scorers, reward.args)."""
    for problem in check_spec(cfg.reward.scorers, cfg.reward.args, cfg.reward.modules):  # imports reward.modules first
        checks.fail(problem)


def check_rewards(cfg, checks: ConfigChecks) -> None:
    """What the reward keys need beyond their names (once `check_reward_keys` passes; it reports otherwise):
    each scorer's local folder (scorers that registered a check, e.g. the CLIP family) and every `remote:`
    server answering /health."""
    if check_spec(cfg.reward.scorers, cfg.reward.args, cfg.reward.modules):
        return
    scorer_kwargs = resolve_args(cfg.reward.scorers, cfg.reward.args)
    # Ray reward actors on a cluster elsewhere read their folders there: only the names are checked here.
    remote_workers = cfg.rollout.reward_actors > 0 and cfg.rollout.address is not None
    for key, name, _ in parse_spec_targets(cfg.reward.scorers):  # name: what `get` builds (a short name's target)
        kwargs = dict(scorer_kwargs.get(key, {}))
        try:
            if remote_workers and not name.startswith(REMOTE):
                if name not in available():
                    raise KeyError(f"unknown scorer {name!r}; known scorers: {', '.join(available())}")
            else:
                check_scorer(name, **kwargs)
        except KeyError as e:
            checks.fail(f"reward.scorers={cfg.reward.scorers!r}: {e.args[0]}")
            continue
        except (ValueError, OSError) as e:
            checks.fail(f"reward.scorers={cfg.reward.scorers!r}: {name}: {e}")
            continue
        if name.startswith(REMOTE):
            _probe_remote(cfg, name, kwargs, checks)
        elif name == "vlm_judge" and not remote_workers:
            _probe_vlm_server(cfg, kwargs, checks, f"reward.scorers={cfg.reward.scorers!r}")


def check_judge_servers(cfg, checks: ConfigChecks) -> None:
    """A vlm_judge among eval.judges answers as a reward's does (`_probe_vlm_server`; its folder-free checks ran
    with the eval keys). Before, a judge whose server was down passed, and the first evaluation failed on it."""
    names = [n.strip() for n in cfg.eval.judges.split(",") if n.strip()]
    if "vlm_judge" not in names:
        return
    try:
        check_scorer("vlm_judge")
    except (ValueError, OSError):
        return  # no base URL: reported by the eval keys' check
    _probe_vlm_server(cfg, {}, checks, f"eval.judges={cfg.eval.judges!r}")


def probe_seconds(cfg) -> float:
    """How long a probe of a reward's server may take: REMOTE_PROBE_S, or reward.timeout_s when that is shorter."""
    return min(REMOTE_PROBE_S, cfg.reward.timeout_s) if cfg.reward.timeout_s > 0 else REMOTE_PROBE_S


def _probe_vlm_server(cfg, kwargs: dict, checks: ConfigChecks, key: str) -> None:
    """The vlm_judge's OpenAI-compatible server lists its models within REMOTE_PROBE_S (the judge asks for them
    when built without model=..., which used to fail after the run directory was written; with a model given,
    an unreachable server masked every reward until reward.max_masked_steps stopped the run)."""
    from rewards.vlm_judge import VlmJudge

    probe_s = probe_seconds(cfg)
    try:
        # model= given, so building asks nothing; the probe is the one listing below, bounded by probe_s.
        judge = VlmJudge(**{**kwargs, "model": kwargs.get("model") or "probe", "timeout_s": probe_s})
        judge._first_model()
    except Exception as e:  # noqa: BLE001  (any failure of the probe is the same answer: not usable)
        checks.fail(f"{key}: vlm_judge's server is not reachable "
                    f"({' '.join(str(e).split('; pass model=')[0].split())}); start it (vLLM or SGLang, OpenAI "
                    "API) or fix base_url")


def _probe_remote(cfg, name: str, kwargs: dict, checks: ConfigChecks) -> None:
    """GET /health of a remote: reward once, within REMOTE_PROBE_S of wall clock (no retries)."""
    probe_s = probe_seconds(cfg)
    try:
        get(name, **{**kwargs, "timeout_s": probe_s, "budget_s": probe_s, "retries": 0,
                     "health_timeout_s": probe_s})
    except Exception as e:  # noqa: BLE001  (any failure of the probe is the same answer: not usable)
        from rewards.remote import TOKEN_ENV

        why = " ".join(str(e).split())
        if "HTTP 401" in why:  # the server wants a token: the fix is the environment, not the address
            checks.fail(f"reward.scorers={cfg.reward.scorers!r}: {name} refused this client's token ({why}); set "
                        f"{TOKEN_ENV} to the token the server was started with")
            return
        checks.fail(f"reward.scorers={cfg.reward.scorers!r}: {name} is not reachable ({why}); "
                    f"start it with `python -m rewards.serve --reward NAME --port PORT`, or fix the address")


def remote_prompt_coverage(cfg, key: str, name: str, prompts: list[str],
                           metadata: list[dict]) -> tuple[list[bool], str] | None:
    """(which rows it scores, what a row needs) from the server of remote: reward `name` (entry `key` of
    reward.scorers), as `rewards.registry.prompt_coverage` answers for an in-process scorer; None when its
    reward does not say (prompt_needs null, or a server without /coverage) or the server is not reachable
    (check_rewards reports that). ValueError with the server's message when it refuses a row (HTTP 400)."""
    from rewards.remote import RemoteRewardError

    probe_s = probe_seconds(cfg)
    kwargs = dict(resolve_args(cfg.reward.scorers, cfg.reward.args).get(key, {}))
    try:
        client = get(name, **{**kwargs, "timeout_s": probe_s, "budget_s": probe_s, "retries": 0,
                              "health_timeout_s": probe_s})
        scored = client.scored_rows(prompts, metadata)
    except RemoteRewardError as e:
        if "with HTTP 400" in str(e):
            raise ValueError(" ".join(str(e).split())) from None
        return None
    except Exception:  # noqa: BLE001  (not reachable, or a bad address: check_rewards names it)
        return None
    return None if scored is None else (scored, client.prompt_needs)


def check_model_path(cfg, checks: ConfigChecks) -> None:
    """`model.path` fits the card (`engine.card_folders.check_card_path`: not empty; a diffusers card's folder
    of the card's family, read from model_index.json and the transformer's config)."""
    try:
        check_card_path(cfg.model.card, cfg.model.path)
    except KeyError:
        return  # reported by the card check
    except ValueError as e:
        checks.fail(f"model.path={cfg.model.path!r} {e}")


# Wall-clock bound (s) of the TCP connect to rollout.address at config time.
RAY_PROBE_S = 3.0


def check_ray_address(cfg, checks: ConfigChecks) -> None:
    """`rollout.address` (Ray: rollout.backend=ray or reward actors) has a form Ray takes, and for host:port
    something listens there: ray.init retries an address nobody serves without end (seen: 212 s of GCS
    retries, still going), after the run dir was written."""
    address = cfg.rollout.address
    if address is None or (cfg.rollout.backend != "ray" and cfg.rollout.reward_actors == 0):
        return
    if address == "local":
        return
    import socket

    if address == "auto":
        found = _running_ray_cluster()
        if found is None:
            checks.fail("rollout.address='auto': no running Ray cluster on this machine (no RAY_ADDRESS, no cluster "
                        "from `ray start`); start one with `ray start --head`, give its host:port, or leave "
                        "rollout.address unset for a local Ray instance")
            return
        if found == "auto":  # Ray could not tell (its discovery moved): ray.init says
            return
        shown, address = f"'auto' (Ray found {found})", found
    else:
        shown = repr(address)
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        checks.fail(f"rollout.address={shown}: must be auto, host:port (a cluster's GCS, e.g. "
                    "127.0.0.1:6379) or ray://host:port (Ray Client)")
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_S).close()
    except OSError as e:
        checks.fail(f"rollout.address={shown}: nothing answers there ({e.strerror or e}); start the cluster "
                    "with `ray start --head` (then rollout.address=auto), or fix the address")


def _running_ray_cluster() -> str | None:
    """The address `ray.init(address="auto")` would join (RAY_ADDRESS, the latest `ray start`, a GCS process
    of this machine), None if there is none (ray.init would raise ConnectionError at the pool's build), or
    "auto" if this Ray has no such lookup."""
    try:
        from ray._private.services import get_ray_address_from_environment  # Ray's own lookup, ray 2.x
    except ImportError:
        return "auto"
    try:
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None


def check_workflow_paths(cfg, checks: ConfigChecks) -> None:
    """`workflow.paths`: each card a workflow runs besides the trained one has a folder that fits it, as
    model.path must for model.card (a card that needs one, none given: said here, not when the first rollout
    loads it)."""
    if cfg.workflow.name is None:
        return
    from engine.workflows import default_registry, stage_paths

    try:
        cards = dict.fromkeys(stage_paths(default_registry(), cfg.workflow.name).values())
    except (KeyError, ValueError):
        return  # reported by check_workflow
    for card in cards:
        if card == cfg.model.card:
            continue
        path = cfg.workflow.paths.get(card)
        try:
            check_card_path(card, path)
        except KeyError:
            continue
        except ValueError as e:
            checks.fail(f"workflow.paths.{card}={path!r} {e} (workflow {cfg.workflow.name!r} runs it frozen)")


# ---------------------------------------------------------------------------------------
# With the model built (before the run directory is written)
# ---------------------------------------------------------------------------------------


def check_lora_targets(cfg, transformer, targets: list[str] | None) -> None:
    """Every LoRA target given in model.lora_targets matches a module of the transformer (peft's rule: the
    module's name is the target or ends with '.' + target); the card's default list must match at least one."""
    if not targets:
        raise ConfigError(f"model.finetune=lora: card {cfg.model.card!r} has no default LoRA targets; set "
                          "model.lora_targets to names of the transformer's Linear layers")
    names = [n for n, _ in transformer.named_modules() if n]
    matched = {t for t in targets if any(n == t or n.endswith("." + t) for n in names)}
    explicit = cfg.model.lora_targets is not None
    unmatched = [t for t in targets if t not in matched]
    if matched and not (explicit and unmatched):
        return
    import torch

    shown = sorted({_block_relative(n) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})
    shown_text = ", ".join(shown[:16]) + (f" and {len(shown) - 16} more" if len(shown) > 16 else "")
    what = type(transformer).__name__
    if explicit:
        raise ConfigError(f"model.lora_targets={list(targets)}: {', '.join(unmatched)} match(es) no module of the "
                          f"{what}; its Linear layers (names within a block): {shown_text}")
    raise ConfigError(f"model.lora_targets=null: card {cfg.model.card!r}'s default targets {list(targets)} match no "
                      f"module of the {what}; set model.lora_targets to some of its Linear layers: {shown_text}")


def _block_relative(name: str) -> str:
    """A module name after its block index ("transformer_blocks.0.attn.to_q" -> "attn.to_q"): the form a LoRA
    target takes; names outside numbered blocks stay whole."""
    parts = name.split(".")
    index = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    return ".".join(parts[index + 1:]) if index is not None else name


def expert_steps(model, experts: str | None, sampling) -> tuple[list[int], list[int]] | None:
    """(the stochastic rollout steps that run the expert `experts` leaves frozen, every step of the trained
    expert) on a two-expert card (wan2.2-t2v: `model.transformer.expert_of`); None for both experts, an ODE
    rollout or a one-transformer card."""
    router = getattr(model.transformer, "expert_of", None)
    if experts not in ("high", "low") or router is None or sampling.sampler == "ode":
        return None
    times = model.schedule(sampling.steps, model.latent_shape(sampling.height, sampling.width, sampling.frames))
    # The forward sees the pipeline's timestep, t x 1000 (engine/families/wan.py).
    trained = [high == (experts == "high") for high in router(times[:sampling.steps].float() * 1000.0).tolist()]
    start, end = sampling.sde_window if sampling.sde_window is not None else (0, sampling.steps)
    return ([i for i in range(start, min(end, sampling.steps)) if not trained[i]],
            [i for i in range(sampling.steps) if trained[i]])


def warn_frozen_expert_sde_steps(cfg, model) -> None:
    """A warning when SDE steps of the rollout run the expert that does not train: noise with no gradient (the
    log-prob ratio of those steps is exactly 1), which a config that trains one expert rarely means."""
    from engine import get_card

    experts = cfg.model.experts or get_card(cfg.model.card).defaults.get("experts")
    steps = expert_steps(model, experts, cfg.sampling)
    if steps is None or not steps[0]:
        return
    frozen, own = steps
    other = "high" if experts == "low" else "low"
    window = None if cfg.sampling.sde_window is None else list(cfg.sampling.sde_window)
    hint = (f"[{own[0]}, {own[-1] + 1}], its steps" if own else
            f"a window of its steps; none of the {cfg.sampling.steps} steps runs it, so raise sampling.steps")
    warn(f"model.experts={experts}: stochastic step(s) {', '.join(map(str, frozen))} of sampling.sde_window={window} "
         f"run the frozen {other}-noise expert, which adds their noise with no gradient; set sampling.sde_window "
         f"to {hint}")


def check_built_model(cfg, model) -> None:
    """The card's size and frame rules for the rollout and evaluation requests, asked of the loaded model
    (`latent_shape`, which the first rollout would call); a video card whose VAE decodes another number of
    frames than requested is said (`decoded_frames`, LTX-2)."""
    if cfg.workflow.name is not None:
        return  # the workflow's stages set their own sizes (engine/workflows), checked when it is built
    s = cfg.sampling
    keys = f"sampling.height={s.height}, sampling.width={s.width}, sampling.frames={s.frames}"
    try:
        model.latent_shape(s.height, s.width, s.frames)
    except ValueError as e:
        raise ConfigError(f"{keys}: {e}") from None
    decoded = getattr(model, "decoded_frames", None)
    if decoded is not None:
        asked, got, why = decoded(s.frames)
        if got != asked:
            warn(f"sampling.frames={s.frames}: {why}")
