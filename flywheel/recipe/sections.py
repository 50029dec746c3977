"""The config sections a recipe builds its Config from, resolving it from the command line (resume included),
and the engine requests the sampling and eval sections make.

The sections and their checks live in flywheel/config/ (`sections`, `validation`); their names are
importable from here, where the recipes import them:

    from flywheel.recipe.sections import DataConfig, ModelConfig, OptimConfig, RunConfig, SamplingConfig
"""

from __future__ import annotations

from flywheel.config.parsing import ConfigError, parse_config
from flywheel.config.sections import (AdvantageConfig, DataConfig, EMAConfig, EvalConfig,  # noqa: F401
                                      ModelConfig, OptimConfig, RewardConfig, RolloutConfig, RunConfig,
                                      SamplingConfig, WorkflowConfig)
from flywheel.config.validation import (card_flag, check_audio_keys, check_dataset_images,  # noqa: F401
                                        check_environment, check_shared_sections)
from flywheel.runs.resume import resume_config

__all__ = ["AdvantageConfig", "DataConfig", "EMAConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RewardConfig",
           "RolloutConfig", "RunConfig", "SamplingConfig", "WorkflowConfig", "audio_request_kwargs", "card_flag",
           "check_audio_keys", "check_dataset_images", "check_environment", "check_shared_sections",
           "eval_request_kwargs", "resolve_config", "rollout_request_kwargs"]


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


def eval_request_kwargs(sampling: SamplingConfig, evaluation: EvalConfig) -> dict:
    """The fields of an evaluation sample: the ODE at the eval guidance, the same seeds every time (no SDE
    window: the rollouts' window may not fit eval.steps, and an ODE has none)."""
    return {"sampler": "ode", "guidance_scale": evaluation.guidance_scale,
            "steps": evaluation.steps or sampling.steps, "sde_window": None, "audio_noise_level": None,
            "cache_threshold": evaluation.cache_threshold, "early_exit": None}
