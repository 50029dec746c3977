"""Configs: the parser, the sections every recipe shares, their checks, and the old key names.

- `parsing`: dataclass configs from defaults, `--config` YAML files and `key=value` overrides (OmegaConf);
- `sections`: one dataclass per owner (`model`, `data`, `sampling`, `reward`, `advantage`, `train`'s
  optimizer keys, `ema`, `eval`, `rollout`, `workflow`) and the top-level run keys;
- `checks`: `ConfigChecks`, which collects every problem of a config into one error;
- `validation`: one check per section and `check_shared_sections`, which runs them before any work;
- `aliases`: the keys renamed when the sections were given to their owners, read under their old names for
  one release;
- `reference`: the key reference of docs/configuration.md, generated from the dataclasses.

Nothing is imported here, so that `flywheel.config.parsing` loads without the engine.
"""
