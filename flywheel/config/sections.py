"""The config sections every recipe shares, one dataclass per owner; docs/configuration.md lists every key.

A recipe's config is `class Config(RunConfig)`: the run keys at the top level (`steps=`, `run_dir=`,
`seed=`...), the sections `model`, `data`, `sampling`, `reward`, `advantage`, `ema`, `eval`, `rollout` and
`workflow`, and `train`, the recipe's own section, a dataclass built on `OptimConfig` so that the optimizer
keys read the same in every recipe. A section's default_factory may give a recipe's own defaults for it.
Each section is checked once (flywheel/config/validation.py); the old key names of the keys that moved here
still work for one release (flywheel/config/aliases.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from flywheel.config.parsing import CONFIG_RELATIVE


BACKENDS = ("local", "ray")
SYNC_BACKENDS = ("object_store", "nccl", "gloo")

@dataclass
class RolloutConfig:
    """Where and when rollouts run: the layout (this process, an engine process, a Ray pool) and its timing."""

    backend: str = "local"
    """local: the engine in the trainer's process (the recipes' layouts); ray: a pool of replica actors"""
    replicas: int = 1
    """rollout replicas in all (split evenly over the trainer's ranks: each rank drives its share)"""
    cpus_per_replica: float = 1.0
    """CPUs Ray reserves for each replica"""
    gpus_per_replica: float = 0.0
    """GPUs Ray reserves for each replica (> 0: the replica's engine runs on CUDA)"""
    address: str | None = None
    """Ray to join: "auto" (a cluster started with `ray start`), "ray://host:10001", or None for a local Ray"""
    sync_backend: str = "object_store"
    """ray backend: object_store (one ray.put read by every replica), nccl (a broadcast group trainer -> replicas,
    GPUs) or gloo (the same group on CPUs)"""
    sync_port: int = 29555
    """nccl/gloo: the group's TCP port on the trainer's host (rank r uses sync_port + r)"""
    max_failures: int = 3
    """failed attempts of one chunk of requests (or of rows to score) before the step stops with an error"""
    reward_actors: int = 0
    """0: rewards are scored in the trainer's process; N > 0: on N Ray actors (RayRewardPool), any backend"""
    cpus_per_reward_actor: float = 1.0
    """CPUs Ray reserves for each reward actor"""
    gpus_per_reward_actor: float = 0.0
    """GPUs Ray reserves for each reward actor (a large scorer on a GPU of its own)"""
    asynchronous: bool = False
    """roll out step s+1 in an engine process while training on step s (one trainer process)"""
    max_staleness: int = 1
    """asynchronous rollouts: a batch may lag the trainer by this many weight versions; older ones are
    regenerated"""
    overlap_scoring: bool = False
    """score each rollout chunk on a background thread while the engine generates the next one"""
    call_timeout_s: float = 600.0
    """engine process and Ray actors: the longest wait for one answer (a chunk of rollouts, a batch to score, a
    weight push) before the step stops with an error; raise it for video models whose chunk takes longer"""
    start_timeout_s: float = 600.0
    """engine process and Ray actors: the longest wait for them to start (Ray: to be placed as well), the
    model's load included; raise it for tens of GB of weights on a slow disk"""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.backend={self.backend!r}: valid backends are {', '.join(BACKENDS)}")
        if self.sync_backend not in SYNC_BACKENDS:
            raise ValueError(f"rollout.sync_backend={self.sync_backend!r}: valid are {', '.join(SYNC_BACKENDS)}")
        if self.replicas < 1:
            raise ValueError(f"rollout.replicas must be >= 1, got {self.replicas}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError(f"rollout.cpus_per_replica and rollout.gpus_per_replica must be >= 0, got "
                             f"{self.cpus_per_replica} and {self.gpus_per_replica}")
        if self.max_failures < 0 or self.reward_actors < 0:
            raise ValueError(f"rollout.max_failures and rollout.reward_actors must be >= 0, got {self.max_failures} "
                             f"and {self.reward_actors}")
        if self.cpus_per_reward_actor < 0 or self.gpus_per_reward_actor < 0:
            raise ValueError(f"rollout.cpus_per_reward_actor and rollout.gpus_per_reward_actor must be >= 0, got "
                             f"{self.cpus_per_reward_actor} and {self.gpus_per_reward_actor}")


@dataclass
class RewardConfig:
    """What scores a sample (the collector calls the scorers; rewards/ holds them)."""

    scorers: str = "digit_alignment:1.0"
    """reward spec: name:weight,name:weight (remote:http://host:port[:weight] for a served reward)"""
    aggregation: Literal["weighted_sum", "sum_of_advantages", "gdpo"] = "weighted_sum"
    """how several scorers combine: advantages of the weighted sum of raw scores, the weighted sum of per-scorer
    group advantages, or gdpo (that sum normalised over the batch)"""
    args: dict[str, Any] = field(default_factory=dict)
    """scorers' constructor arguments by spec name: reward.args.pickscore.path=/models/pickscore"""
    modules: list[str] = field(default_factory=list)
    """modules imported before the scorers are checked, for scorers they register (rewards.registry.register)"""
    timeout_s: float = 60.0
    """remote scorers: wall-clock bound (s) of one HTTP call to a remote:<url> server, connect to last byte"""
    budget_s: float = 120.0
    """remote scorers: wall-clock bound (s) of all attempts (retries, backoff) to score one batch"""
    max_masked_steps: int = 3
    """stop with an error after this many consecutive steps whose every sample the scorers masked"""
    max_flat_steps: int = 10
    """stop with an error after this many consecutive steps in which every group's rewards were equal (a policy
    that gives every sample of a prompt one reward, collapsed or saturated, leaves nothing to learn from)"""


@dataclass
class AdvantageConfig:
    """How a step's rewards become the advantages the update trains on (flywheel/advantages.py); GRPO, NFT and
    AWM read it, and DPO and DRaFT, which train on no advantages, refuse a key set here."""

    global_std: bool = False
    """normalise advantages by the std of all the step's rewards (Flow-GRPO's sample.global_std), not each group's"""
    clip_max: float = 5.0
    """advantages are clipped to [-clip_max, clip_max]"""


@dataclass
class EMAConfig:
    """An exponential moving average of the trained weights (flywheel/recipe/ema.py, Flow-GRPO's train.ema)."""

    enabled: bool = False
    """keep the EMA: evaluation uses it and a LoRA run exports it as lora_ema/ beside the trained lora/, rollouts
    keep the trained weights, checkpoints hold both"""
    decay: float = 0.9
    """EMA <- decay·EMA + (1 - decay)·weights, the decay ramping as min(decay, (1 + n)/(10 + n)) over the n
    training steps since start_step (Flow-GRPO: 0.9)"""
    start_step: int = 0
    """training steps during which the EMA is the trained weights; it averages from then on"""
    update_every: int = 8
    """the EMA moves after every N-th training step from start_step (Flow-GRPO: every 8 optimizer steps)"""


@dataclass
class EvalConfig:
    """The held-out evaluation: ODE samples of data.eval_prompts at fixed seeds, scored by the reward and judges."""

    every: int = 20
    """evaluate every N steps (and at the start and end)"""
    seeds: int = 4
    """samples per evaluation prompt (fixed seeds)"""
    steps: int | None = None
    """denoising steps of the ODE evaluation samples; None = sampling.steps"""
    guidance_scale: float = 1.0
    """classifier-free guidance of the ODE evaluation samples"""
    cache_threshold: float = 0.0
    """evaluate with the adaptive loop (engine/adaptive.py): skip the model while a sample's velocity is estimated
    to change by less than this (relative); 0 = the plain loop. Metrics rows then carry eval/model_calls"""
    judges: str = ""
    """scorers that only evaluate (eval/judge/<name>/mean), never reward: comma-separated names, e.g. vlm_judge"""
    stop_on_hacking: int = 0
    """end the run (exit 0) after this many consecutive evaluations where the hacking watch fired; best/ and the
    last checkpoint saved before the signals are kept (flywheel/recipe/hacking_stop.py). 0 = off"""


@dataclass
class WorkflowConfig:
    """RL through a workflow (flywheel/recipe/workflow.py): one stage's card is trained, the others run frozen."""

    name: str | None = None
    """train one stage of this workflow (engine.workflows, e.g. toy.digits_then_refine) with the reward on the
    workflow's final output; workflow.stage names the stage, model.card must be its card"""
    stage: str | None = None
    """the stage trained (the workflow's first card stage, e.g. draw); the others run the ODE frozen"""
    paths: dict[str, str] = field(default_factory=dict)
    """local folders of the workflow's other cards, card id -> path (the trained card's is model.path)"""


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
    """transformer weight dtype; latents and log-probs stay fp32, a LoRA's adapter is fp32; float16 only with
    finetune=lora (AdamW's state in float16 underflows)"""
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
    """Flow-SDE noise level a (CPS: eta in [0, 1); the ODE draws none, so another value is refused with it)"""
    guidance_scale: float = 1.0
    """classifier-free guidance of rollouts (1 = no unconditional branch)"""
    sde_window: tuple[int, int] | None = None
    """[start, end) of the stochastic (trained) steps; None = all steps (the ODE has none: refused with it)"""
    time_shift: float = 1.0
    """SD3-style time shift of the schedule"""
    same_noise_per_group: bool = False
    """every sample of a prompt's group starts from the same initial noise (MixGRPO's --init_same_noise); each
    sample's SDE step noise stays its own, so the group differs only by the stochastic steps"""
    cache_threshold: float = 0.0
    """training rollouts through the adaptive loop (engine/adaptive.py), as eval.cache_threshold: every step of an
    ODE rollout (nft, awm, dpo, draft: they train no per-step log-probs), only the ODE steps after the SDE window of a
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
    # What train.minibatch_size counts: rollout rows (every recipe but DPO, whose minibatches are pairs and whose
    # pair count changes from step to step). Rows must split into equal minibatches (check_minibatches).
    MINIBATCH_UNIT: ClassVar[str] = "rows"

    learning_rate: float = 3e-4
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    minibatch_size: int = 128
    """rollout rows per training forward; must divide the rows of a step on each process (prompts_per_step x
    group_size / processes); DPO's counts pairs, any number"""
    gradient_accumulation_steps: int = 1
    """minibatches accumulated into one optimizer step"""
    updates_per_rollout: int | None = None
    """optimizer steps per rollout batch (the minibatches split evenly); None = set by gradient_accumulation_steps"""
    gradient_checkpointing: bool = False
    """recompute the transformer's activations in backward (less memory, ~30% slower; diffusers models)"""


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
    reward: RewardConfig = field(default_factory=RewardConfig)
    """the scorers, their weights and arguments, how several combine, and the failure bounds of remote ones"""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """how rewards become advantages: the normalisation and the clip"""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """an EMA of the trained weights that evaluation uses and checkpoints keep"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """the evaluation: its cadence, samples, judges, and the stop on reward hacking"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """where rollouts and rewards run (this process, an engine process, Ray actors) and their timing"""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """train one stage of a multi-stage workflow, scored on the workflow's final output"""
    # Last, so a recipe's own sections (sampling, train) follow them as they did when each recipe declared these.
    model: ModelConfig = field(default_factory=ModelConfig)
    """the model card, its weights and what is trained"""
    data: DataConfig = field(default_factory=DataConfig)
    """training and evaluation prompts, prompts per step and group size"""


# ---- the engine requests the sampling and eval sections make --------------------------------------------------


def audio_request_kwargs(sampling: SamplingConfig) -> dict:
    """The audio fields of a request: none without sound, so video-only cards see unchanged requests."""
    if not sampling.audio:
        return {}
    return dict(audio=True, audio_guidance_scale=sampling.audio_guidance_scale)


def rollout_request_kwargs(sampling: SamplingConfig) -> dict:
    """The GenerationRequest fields of a training rollout, from the sampling section."""
    # The ODE takes no noise level (the request refuses one); the config checks refuse one set beside it.
    noise_level = None if sampling.sampler == "ode" else sampling.noise_level
    kwargs = dict(steps=sampling.steps, sampler=sampling.sampler, noise_level=noise_level,
                  guidance_scale=sampling.guidance_scale, sde_window=sampling.sde_window,
                  height=sampling.height, width=sampling.width, frames=sampling.frames,
                  **audio_request_kwargs(sampling))
    if sampling.audio:
        kwargs["audio_noise_level"] = sampling.audio_noise_level
    if sampling.cache_threshold > 0 or sampling.early_exit is not None:  # the plain loop's requests otherwise
        kwargs.update(cache_threshold=sampling.cache_threshold, early_exit=sampling.early_exit)
    return kwargs


def eval_request_kwargs(sampling: SamplingConfig, evaluation: EvalConfig) -> dict:
    """The fields of an evaluation sample: the ODE at the eval guidance, the same seeds every time (no SDE
    window: the rollouts' window may not fit eval.steps, and an ODE has none)."""
    return {"sampler": "ode", "guidance_scale": evaluation.guidance_scale, "noise_level": None,
            "steps": evaluation.steps or sampling.steps, "sde_window": None, "audio_noise_level": None,
            "cache_threshold": evaluation.cache_threshold, "early_exit": None}
