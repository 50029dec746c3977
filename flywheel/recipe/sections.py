"""Moved to flywheel/config/ in issue 24: the section dataclasses and the requests they make
(`flywheel.config.sections`), `resolve_config` (`flywheel.config.parsing`) and the checks
(`flywheel.config.validation`). The names are re-exported here for one release."""

from __future__ import annotations

from flywheel.config.parsing import resolve_config  # noqa: F401
from flywheel.config.sections import (AdvantageConfig, DataConfig, EMAConfig, EvalConfig,  # noqa: F401
                                      ModelConfig, OptimConfig, RewardConfig, RolloutConfig, RunConfig,
                                      SamplingConfig, WorkflowConfig, audio_request_kwargs, eval_request_kwargs,
                                      rollout_request_kwargs)
from flywheel.config.validation import (card_flag, check_audio_keys, check_dataset_images,  # noqa: F401
                                        check_environment, check_shared_sections)

__all__ = ["AdvantageConfig", "DataConfig", "EMAConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RewardConfig",
           "RolloutConfig", "RunConfig", "SamplingConfig", "WorkflowConfig", "audio_request_kwargs", "card_flag",
           "check_audio_keys", "check_dataset_images", "check_environment", "check_shared_sections",
           "eval_request_kwargs", "resolve_config", "rollout_request_kwargs"]
