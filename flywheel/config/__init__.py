"""Configs: the parser, the sections every recipe shares, their checks, and the old key names.

- `parsing`: dataclass configs from defaults, `--config` YAML files and `key=value` overrides (OmegaConf), and
  `resolve_config`, a recipe's config from its command line or from the run it resumes;
- `sections`: one dataclass per owner (`model`, `data`, `sampling`, `reward`, `advantage`, `train`'s
  optimizer keys, `ema`, `eval`, `rollout`, `workflow`), the top-level run keys, and the engine requests
  the sampling and eval sections make;
- `validation`: one check per section, `check_shared_sections`, which runs them before any work, and
  `ConfigChecks`, which collects every problem into one error;
- `aliases`: the keys renamed when the sections were given to their owners, read under their old names for
  one release;
- `reference`: the key reference of docs/configuration.md, generated from the dataclasses.

Nothing is imported here, so that `flywheel.config.parsing` loads without the engine.
"""
