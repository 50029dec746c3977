"""The config sections every recipe shares, their checks, and resolving a recipe's config from the command line.

A recipe's config is `class Config(RunConfig)` (the run keys at the top level:
`steps=`, `run_dir=`, `seed=`...) with the sections `model`, `data`,
`sampling` and `train`; its `train` section is its own dataclass built on
`OptimConfig`, so the optimizer keys read the same in every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine import get_card, list_cards
from flywheel.prompts import load_prompts
from flywheel.recipe.preflight import (check_bounds, check_minibatches, check_model_path, check_reward_keys,
                                       check_rewards, check_run_dir, warn_prompts_per_step)
from flywheel.recipe.workflow import check_workflow_keys
from flywheel.runs.checks import ConfigChecks, config_value
from flywheel.runs.config import CONFIG_RELATIVE, ConfigError, parse_config
from flywheel.runs.resume import resume_config
from flywheel.scale.config import RolloutConfig


@dataclass
class ModelConfig:
    card: str = "toy-digits"
    """model card id (see `engine.list_cards()`)"""
    path: str | None = None
    """local weights folder; None uses the weights the project ships (toy cards only)"""
    finetune: Literal["full", "lora"] = "full"
    """train every transformer weight, or a LoRA adapter (peft)"""
    lora_rank: int = 8
    """LoRA rank r"""
    lora_alpha: float = 8.0
    """LoRA alpha (scale = alpha / r)"""
    lora_targets: list[str] | None = None
    """Linear layers to adapt; None uses the card's default"""
    lora_init: Literal["default", "gaussian"] = "default"
    """LoRA A init: peft's Kaiming-uniform, or gaussian N(0, 1/r) as Flow-GRPO (B = 0 either way)"""
    experts: Literal["both", "high", "low"] | None = None
    """two-expert cards (wan2.2-t2v): the experts that train, the high-noise one, the low-noise one or both;
    None = the card's default (both)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """transformer weight dtype; latents and log-probs stay fp32"""
    workflow: str | None = None
    """train one stage of this workflow (engine.workflows, e.g. toy.digits_then_refine) with the reward on the
    workflow's final output; train.stage names the stage, model.card must be its card"""
    workflow_paths: dict[str, str] = field(default_factory=dict)
    """local folders of the workflow's other cards, card id -> path (the trained card's is model.path)"""
    compile: bool = False
    """torch.compile the rollout forward (engine/compiling.py): the first rollout pays for compiling, training
    stays eager, and the on-policy ratio is 1 up to rounding (fp32 ~5e-7, bf16 ~1e-5) instead of exactly"""


@dataclass
class DataConfig:
    prompts: str = field(default="toy-digits", metadata={CONFIG_RELATIVE: True})
    """training prompts: a built-in dataset name or a .txt / .jsonl file (in a --config file: relative to the
    working directory, else to the config file's folder)"""
    eval_prompts: str = field(default="toy-digits-heldout", metadata={CONFIG_RELATIVE: True})
    """held-out evaluation prompts (same forms as `prompts`)"""
    prompts_per_step: int = 8
    """distinct prompts per step (over all ranks)"""
    group_size: int = 16
    """samples per prompt (G); advantages are normalised within each group"""


@dataclass
class SamplingConfig:
    steps: int = 10
    """denoising steps of a rollout"""
    sampler: Literal["sde", "cps", "ode"] = "sde"
    """rollout sampler: Flow-SDE, coefficients-preserving sampling (noise_level is then eta), or the ODE"""
    noise_level: float = 0.7
    """Flow-SDE noise level a (CPS: eta in [0, 1); unused by the ODE)"""
    guidance_scale: float = 1.0
    """classifier-free guidance of rollouts (1 = no unconditional branch)"""
    sde_window: tuple[int, int] | None = None
    """[start, end) of the stochastic (trained) steps; None = all steps"""
    time_shift: float = 1.0
    """SD3-style time shift of the schedule"""
    same_noise_per_group: bool = False
    """every sample of a prompt's group starts from the same initial noise (MixGRPO's --init_same_noise); each
    sample's SDE step noise stays its own, so the group differs only by the stochastic steps"""
    eval_guidance_scale: float = 1.0
    """guidance of the ODE evaluation samples"""
    eval_seeds: int = 4
    """samples per evaluation prompt (fixed seeds)"""
    eval_steps: int | None = None
    """denoising steps of the ODE evaluation samples; None = `steps`"""
    eval_cache_threshold: float = 0.0
    """evaluate with the adaptive loop (engine/adaptive.py): skip the model while a sample's velocity is estimated
    to change by less than this (relative); 0 = the plain loop. Metrics rows then carry eval/model_calls"""
    cache_threshold: float = 0.0
    """training rollouts through the adaptive loop (engine/adaptive.py), as eval_cache_threshold: every step of an
    ODE rollout (nft, awm, dpo: they train no per-step log-probs), only the ODE steps after the SDE window of a
    GRPO rollout (its trained steps stay exact); 0 = the plain loop. Metrics rows then carry rollout/model_calls"""
    early_exit: float | None = None
    """training rollouts: stop calling the model for a sample once its predicted image would change by less than
    this until t = 0 (the adaptive loop's early exit, on the same steps as cache_threshold); null = never"""
    height: int | None = None
    """image / video height in pixels; None uses the card's native size"""
    width: int | None = None
    """image / video width in pixels; None uses the card's native size"""
    frames: int | None = None
    """video frames (video cards only; None uses the card's default)"""
    audio: bool = False
    """generate sound with the video (joint audio+video cards: ltx2); false = the card's video-only path"""
    audio_guidance_scale: float | None = None
    """the audio's classifier-free guidance (rollouts and evaluation); null = the video's"""
    audio_noise_level: float | None = None
    """the audio's Flow-SDE / CPS noise level in rollouts; null = noise_level, 0 = deterministic audio steps"""


@dataclass
class OptimConfig:
    learning_rate: float = 3e-4
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    adv_clip_max: float = 5.0
    """advantages are clipped to [-adv_clip_max, adv_clip_max]"""
    global_std: bool = False
    """normalise advantages by the std of all the step's rewards (Flow-GRPO's sample.global_std), not each group's"""
    minibatch_size: int = 128
    """samples per training forward"""
    gradient_accumulation_steps: int = 1
    """minibatches accumulated into one optimizer step"""
    updates_per_rollout: int | None = None
    """optimizer steps per rollout batch (the minibatches split evenly); None = set by gradient_accumulation_steps"""
    max_masked_steps: int = 3
    """stop with an error after this many consecutive steps whose every sample the rewards masked"""
    gradient_checkpointing: bool = False
    """recompute the transformer's activations in backward (less memory, ~30% slower; diffusers models)"""
    ema: bool = False
    """keep an EMA of the trained weights (Flow-GRPO's train.ema): evaluation uses it and a LoRA run exports it as
    lora_ema/ beside the trained lora/, rollouts keep the trained weights, checkpoints hold both (flywheel/recipe/ema.py)"""
    ema_decay: float = 0.9
    """EMA <- decay·EMA + (1 - decay)·weights, the decay ramping as min(ema_decay, (1 + n)/(10 + n)) over the
    n training steps since ema_start_step (Flow-GRPO: 0.9)"""
    ema_start_step: int = 0
    """training steps during which the EMA is the trained weights; it averages from then on"""
    ema_update_every: int = 8
    """the EMA moves after every N-th training step from ema_start_step (Flow-GRPO: every 8 optimizer steps)"""
    stop_on_hacking: int = 0
    """end the run (exit 0) after this many consecutive evaluations where the hacking watch fired; best/ and the
    last checkpoint saved before the signals are kept (flywheel/recipe/hacking_stop.py). 0 = off"""
    stage: str | None = None
    """with model.workflow: the stage trained (its first card stage, e.g. draw); the others run the ODE frozen"""


@dataclass
class RunConfig:
    run_dir: str = "runs/toy"
    """where config, metrics, samples and checkpoints go"""
    seed: int = 0
    """seed of prompts, rollouts and the update's random draws"""
    threads: int | None = None
    """torch threads per CPU process (null/0: OMP_NUM_THREADS if set, else the cores divided among the processes)"""
    steps: int = 80
    """training steps (rollout + update)"""
    rewards: str = "digit_alignment:1.0"
    """reward spec: name:weight,name:weight (remote:http://host:port[:weight] for a served reward)"""
    rewards_mode: Literal["weighted_sum", "sum_of_advantages", "gdpo"] = "weighted_sum"
    """advantages of the weighted sum of raw scores, the weighted sum of per-reward group advantages, or gdpo
    (that sum normalised over the batch)"""
    reward_timeout_s: float = 60.0
    """remote rewards: wall-clock bound (s) of one HTTP call to a remote:<url> server, connect to last byte"""
    reward_budget_s: float = 120.0
    """remote rewards: wall-clock bound (s) of all attempts (retries, backoff) to score one batch"""
    async_rollouts: bool = False
    """roll out step s+1 in an engine process while training on step s (one trainer process)"""
    max_staleness: int = 1
    """async rollouts: a batch may lag the trainer by this many weight versions; older ones are regenerated"""
    overlap_scoring: bool = False
    """score each rollout chunk on a background thread while the engine generates the next one"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """where rollouts and rewards run: this process (local) or Ray actors (backend=ray, reward_actors)"""
    eval_every: int = 20
    """evaluate every N steps (and at the start and end)"""
    sample_every: int = 20
    """save a sample grid every N steps"""
    save_every: int = 20
    """checkpoint every N steps (and at the end)"""
    keep_checkpoints: int = 2
    """checkpoints kept on disk"""
    resume: str | None = None
    """run dir or checkpoint dir to continue from"""
    overwrite: bool = False
    """start a fresh run in a run dir that holds an earlier run, deleting that run's files"""
    tracker: str = "wandb"
    """experiment trackers, one or several: wandb, tensorboard, trackio, mlflow (e.g. wandb,trackio), or none
    (wandb runs offline when no account is configured)"""
    project: str = "flywheel"
    """tracker project name"""
    reward_modules: list[str] = field(default_factory=list)
    """modules imported before the rewards are checked, for scorers they register (rewards.registry.register)"""
    reward_args: dict[str, Any] = field(default_factory=dict)
    """scorers' constructor arguments by spec name: reward_args.pickscore.path=/models/pickscore"""
    eval_judges: str = ""
    """scorers that only evaluate (eval/judge/<name>/mean), never reward: comma-separated names, e.g. vlm_judge"""


def resolve_config(config_class: type, argv: list[str], recipe: str | None = None):
    """The CLI config; with resume=RUN, the run's saved config.yaml is the base, and the CLI's keys that differ
    from it must be ones a resume may change (flywheel/runs/resume.py); `recipe` must be the run's."""
    cfg = parse_config(config_class, argv)
    if cfg.resume:
        if cfg.overwrite:
            raise ConfigError("resume= continues a run and overwrite=true deletes one: give only one of them")
        # The newest checkpoint that verifies (a corrupt newer one is skipped with a warning);
        # a run dir without its config.yaml is refused rather than resumed with defaults.
        cfg = resume_config(config_class, argv, cfg.resume, recipe)
    return cfg


def check_shared_sections(cfg) -> ConfigChecks:
    """Check the shared keys (run, model, data, sampling, optimizer); the recipe adds its own, then raises.

    Returns the ConfigChecks so that every bad key, shared or the recipe's, comes in one ConfigError.
    """
    checks = ConfigChecks(cfg)
    positive = "must be an integer >= 1"
    for key in ("steps", "eval_every", "sample_every", "save_every", "keep_checkpoints", "data.prompts_per_step",
                "sampling.steps", "sampling.eval_seeds", "train.minibatch_size", "train.gradient_accumulation_steps",
                "train.max_masked_steps", "model.lora_rank"):
        checks.require(key, lambda v: v >= 1, positive)
    for key in ("sampling.eval_steps", "sampling.height", "sampling.width", "sampling.frames",
                "train.updates_per_rollout"):
        checks.require(key, lambda v: v >= 1, positive + " or null", allow_none=True)
    checks.require("seed", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("threads", lambda v: v >= 0, "must be an integer >= 0 or null (0/null: OMP_NUM_THREADS, else "
                   "the cores divided among the processes)", allow_none=True)
    checks.require("max_staleness", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("data.group_size", lambda v: v >= 2, "must be >= 2: advantages compare the samples of a group")
    sampler = cfg.sampling.sampler
    if sampler == "cps":
        checks.require("sampling.noise_level", lambda v: 0 < v < 1, "is CPS's eta for sampler=cps: in (0, 1)")
    elif sampler == "sde":
        checks.require("sampling.noise_level", lambda v: 0 < v <= 10, "is Flow-SDE's a: in (0, 10] (0 is the ODE)")
    if cfg.sampling.same_noise_per_group and sampler == "ode":
        checks.fail("sampling.same_noise_per_group=true with sampling.sampler=ode: every sample of a group would "
                    "be the same image (no reward spread, nothing to train on); use sampler=sde or cps, or set "
                    "same_noise_per_group=false")
    for key in ("sampling.guidance_scale", "sampling.eval_guidance_scale"):
        checks.require(key, lambda v: 0 <= v <= 100, "must be in [0, 100] (1 = no guidance)")
    checks.require("sampling.eval_cache_threshold", lambda v: 0 <= v <= 1,
                   "must be in [0, 1] (0 = the plain loop; the toy eval keeps its reward within 0.01 at 0.15)")
    check_rollout_cache_keys(cfg, checks)
    checks.require("sampling.time_shift", lambda v: 0 < v <= 100, "must be in (0, 100] (1 = no shift)")
    checks.require("sampling.sde_window", lambda w: 0 <= w[0] < w[1] <= cfg.sampling.steps,
                   f"must be [start, end) with 0 <= start < end <= sampling.steps ({cfg.sampling.steps})",
                   allow_none=True)
    check_audio_keys(cfg, checks)
    check_workflow_keys(cfg, checks)
    checks.require("train.learning_rate", lambda v: 0 < v <= 1, "must be in (0, 1]")
    for key in ("reward_timeout_s", "reward_budget_s"):
        checks.require(key, lambda v: v > 0, "must be a number of seconds > 0")
    if cfg.rewards_mode == "gdpo" and cfg.train.global_std:
        checks.fail("train.global_std=true does nothing with rewards_mode=gdpo, which normalises over the batch "
                    "already: set one of them")
    checks.require("train.weight_decay", lambda v: v >= 0, "must be >= 0")
    checks.require("train.adam_betas", lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                   "must be two numbers in [0, 1)")
    for key in ("train.max_grad_norm", "train.adv_clip_max", "model.lora_alpha"):
        checks.require(key, lambda v: v > 0, "must be > 0")
    checks.require("train.ema_decay", lambda v: 0 <= v < 1,
                   "must be in [0, 1) (EMA <- decay·EMA + (1 - decay)·weights; 0 = the trained weights)")
    checks.require("train.ema_start_step", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("train.ema_update_every", lambda v: v >= 1, positive)
    checks.require("train.stop_on_hacking", lambda v: v >= 0, "must be an integer >= 0 (0 = off)")
    try:
        get_card(cfg.model.card)
    except (KeyError, ValueError) as e:
        checks.fail(f"model.card={cfg.model.card!r}: {e}")
    else:
        if cfg.model.experts is not None and "experts" not in get_card(cfg.model.card).defaults:
            checks.fail(f"model.experts={cfg.model.experts}: card {cfg.model.card!r} has one transformer; the key "
                        f"chooses the trained experts of a two-expert card ("
                        f"{', '.join(c for c in list_cards() if 'experts' in get_card(c).defaults)}); leave it unset")
    try:
        from flywheel.runs.tracking import tracker_names

        tracker_names(cfg.tracker)
    except ValueError as e:
        checks.fail(str(e))
    for name in [n.strip() for n in cfg.eval_judges.split(",") if n.strip()]:
        from rewards.registry import available

        if name not in available():
            checks.fail(f"eval_judges names {name!r}, which is not a registered scorer; known: {', '.join(available())}")
    for key in ("data.prompts", "data.eval_prompts"):
        try:
            items = load_prompts(config_value(cfg, key))
        except (OSError, ValueError) as e:
            checks.fail(f"{key}={config_value(cfg, key)!r}: {e}")
        else:
            check_dataset_images(cfg, key, items, checks)
            if key == "data.prompts":
                warn_prompts_per_step(cfg, len(items))
    check_reward_keys(cfg, checks)
    check_bounds(cfg, checks)
    check_minibatches(cfg, checks)
    check_environment(cfg, checks)
    return checks


def check_environment(cfg, checks: ConfigChecks) -> None:
    """What needs more than the config's values, still before anything is written: the run dir is usable, the
    model folder is the card's, the scorers' folders are there and remote reward servers answer."""
    check_run_dir(cfg, checks)
    check_model_path(cfg, checks)
    check_rewards(cfg, checks)


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
    shown = ", ".join(map(str, rows[:10])) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")
    if conditioned:
        checks.fail(f"{key}={config_value(cfg, key)!r}: card {cfg.model.card!r} is conditioned on an image per prompt "
                    f"(a first frame, or the source image of an edit), but "
                    f"prompt(s) {shown} have none: use a .jsonl whose rows are "
                    f"{{\"prompt\": ..., \"image\": \"path.png\"}}")
    else:
        checks.fail(f"{key}={config_value(cfg, key)!r}: prompt(s) {shown} name an \"image\" but card "
                    f"{cfg.model.card!r} takes none; only image-conditioned cards (image-to-video, editing) do")


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


def audio_request_kwargs(sampling: SamplingConfig) -> dict:
    """The audio fields of a request: none without sound, so video-only cards see unchanged requests."""
    if not sampling.audio:
        return {}
    return dict(audio=True, audio_guidance_scale=sampling.audio_guidance_scale)


def rollout_request_kwargs(sampling: SamplingConfig) -> dict:
    """The GenerationRequest fields of a training rollout, from the sampling section."""
    kwargs = dict(steps=sampling.steps, sampler=sampling.sampler, noise_level=sampling.noise_level,
                  guidance_scale=sampling.guidance_scale, sde_window=sampling.sde_window,
                  height=sampling.height, width=sampling.width, frames=sampling.frames,
                  **audio_request_kwargs(sampling))
    if sampling.audio:
        kwargs["audio_noise_level"] = sampling.audio_noise_level
    if sampling.cache_threshold > 0 or sampling.early_exit is not None:  # the plain loop's requests otherwise
        kwargs.update(cache_threshold=sampling.cache_threshold, early_exit=sampling.early_exit)
    return kwargs


def eval_request_kwargs(sampling: SamplingConfig) -> dict:
    """The fields of an evaluation sample: the ODE at the eval guidance, the same seeds every time (no SDE
    window: the rollouts' window may not fit sampling.eval_steps, and an ODE has none)."""
    return {"sampler": "ode", "guidance_scale": sampling.eval_guidance_scale,
            "steps": sampling.eval_steps or sampling.steps, "sde_window": None, "audio_noise_level": None,
            "cache_threshold": sampling.eval_cache_threshold, "early_exit": None}
