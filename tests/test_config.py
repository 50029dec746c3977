"""flywheel.runs.config: defaults < YAML < CLI, coercion, errors that name the valid keys, help, round trip.

OmegaConf does the typing underneath; these tests pin the behaviour a user sees,
including the cases where the wrapper fills a gap of OmegaConf 2.4.
"""

from __future__ import annotations

import dataclasses
import importlib
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest
import yaml

from flywheel.runs.config import (
    ConfigError,
    apply_overrides,
    config_help,
    config_to_dict,
    field_docstrings,
    load_config,
    parse_config,
    save_config,
)

# OmegaConf 2.4 deprecates (FutureWarning) the converting item assignment: the module must not rely on it.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    clip: Optional[float] = 1.0
    """Gradient clipping norm (none disables it)."""


@dataclass
class SamplerConfig:
    kind: Literal["ode", "sde", "cps"] = "sde"
    """Sampler of the rollouts."""
    steps: int = 10
    """Denoising steps per rollout."""
    order: Literal[1, 2] = 1
    """Solver order."""


@dataclass
class EmaConfig:
    decay: float = 0.99
    """EMA decay per step."""


@dataclass
class TrainConfig:
    """A tiny training config for the tests."""

    seed: int = 0
    """Seed of torch, numpy and random."""
    run_name: str | None = None
    """Name of the run directory (none: derived from the time)."""
    compile: bool = False
    """Whether to torch.compile the model."""
    size: tuple[int, int] = (8, 8)
    """Image height and width."""
    prompts: list[str] = field(default_factory=lambda: ["a", "b"])
    """Training prompts."""
    targets: list[str] | None = None
    """Layers to adapt (none: the model's default)."""
    window: tuple[int, int] | None = None
    """[start, end) of the trained steps (none: all)."""
    out_dir: Path = Path("runs")
    """Where run directories go."""
    reward_weights: dict[str, float] = field(default_factory=lambda: {"digit": 1.0})
    """Weight of each reward scorer in the total."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Rollout sampler settings."""
    ema: EmaConfig | None = None
    """EMA of the weights (none: off)."""


@dataclass
class RequiredConfig:
    model_path: str
    """Local path of the model weights."""
    steps: int = 1
    """Training steps."""


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_defaults():
    cfg = parse_config(TrainConfig, [])
    assert cfg == TrainConfig()
    assert cfg.optim.lr == 1e-4 and cfg.sampler.kind == "sde" and cfg.ema is None


def test_yaml_then_cli_precedence(tmp_path):
    a = write_yaml(tmp_path / "a.yaml", {"seed": 1, "optim": {"lr": 0.5}, "sampler": {"steps": 20}})
    b = write_yaml(tmp_path / "b.yaml", {"seed": 2})
    cfg = parse_config(TrainConfig, ["--config", str(a), f"--config={b}", "optim.lr=3e-4"])
    assert cfg.seed == 2  # the later file wins
    assert cfg.optim.lr == 3e-4  # the CLI wins over YAML
    assert cfg.sampler.steps == 20  # a YAML section merges: other keys keep their defaults
    assert cfg.sampler.kind == "sde" and cfg.optim.betas == (0.9, 0.999)
    # CLI overrides apply after YAML even when written before --config
    cfg = parse_config(TrainConfig, ["seed=7", "--config", str(a)])
    assert cfg.seed == 7


def test_yaml_dotted_top_level_keys(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "optim.lr: 1e-3\nsampler.kind: ode\n")
    cfg = load_config(TrainConfig, path)
    assert cfg.optim.lr == 1e-3 and cfg.sampler.kind == "ode"


@pytest.mark.parametrize("arg, attr, expected", [
    ("seed=3", "seed", 3),
    ("seed=1e3", "seed", 1000),
    ("optim.lr=1e-3", "optim.lr", 1e-3),
    ("optim.lr=2", "optim.lr", 2.0),
    ("compile=true", "compile", True),
    ("compile=YES", "compile", True),
    ("compile=1", "compile", True),
    ("compile=False", "compile", False),
    ("compile=no", "compile", False),
    ("compile=0", "compile", False),
    ("run_name=exp1", "run_name", "exp1"),
    ("run_name=none", "run_name", None),
    ("run_name=NULL", "run_name", None),
    ("optim.clip=none", "optim.clip", None),
    ("optim.clip=0.5", "optim.clip", 0.5),
    ("seed=1000.0", "seed", 1000),
    ("targets=[to_q,to_k]", "targets", ["to_q", "to_k"]),
    ("targets=to_q", "targets", ["to_q"]),
    ("targets=none", "targets", None),
    ("window=[0,5]", "window", (0, 5)),
    ("window=0,5", "window", (0, 5)),
    ("window=[1e0, 5.0]", "window", (1, 5)),  # each item as its own type: int, from 1e0
    ("window=null", "window", None),
    ("sampler.order=2", "sampler.order", 2),
    ("optim={lr: 2, clip: none}", "optim", OptimConfig(lr=2.0, clip=None)),
    ("reward_weights.a.b=2", "reward_weights", {"digit": 1.0, "a.b": 2.0}),
    ("size=16,32", "size", (16, 32)),
    ("size=[16, 32]", "size", (16, 32)),
    ("size=(4,4)", "size", (4, 4)),
    ("optim.betas=0.8,0.95", "optim.betas", (0.8, 0.95)),
    ("prompts=x,y,z", "prompts", ["x", "y", "z"]),
    ("prompts=[a cat, a dog]", "prompts", ["a cat", "a dog"]),
    ("prompts=", "prompts", []),
    ("out_dir=/tmp/runs", "out_dir", Path("/tmp/runs")),
    ("sampler.kind=ode", "sampler.kind", "ode"),
    ("reward_weights.judge=0.5", "reward_weights", {"digit": 1.0, "judge": 0.5}),
    ("reward_weights={a: 2}", "reward_weights", {"a": 2.0}),
    ("ema.decay=0.9", "ema", EmaConfig(decay=0.9)),
    ("--seed=4", "seed", 4),
])
def test_cli_coercion(arg, attr, expected):
    cfg = parse_config(TrainConfig, [arg])
    value = cfg
    for part in attr.split("."):
        value = getattr(value, part)
    assert value == expected
    assert type(value) is type(expected)


def test_yaml_coercion(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", (
        "seed: 5\n"
        "compile: yes\n"
        "size: [2, 3]\n"
        "run_name: null\n"
        "optim:\n  lr: 1e-3\n  clip: ~\n  betas: [0.5, 0.6]\n"  # YAML 1.1 reads 1e-3 as a string
        "ema: {decay: 0.5}\n"
    ))
    cfg = load_config(TrainConfig, path)
    assert cfg.seed == 5 and cfg.compile is True and cfg.size == (2, 3) and cfg.run_name is None
    assert cfg.optim == OptimConfig(lr=1e-3, betas=(0.5, 0.6), clip=None)
    assert cfg.ema == EmaConfig(decay=0.5)


def test_optional_section_can_be_set_back_to_none():
    cfg = parse_config(TrainConfig, ["ema.decay=0.5", "ema=none"])
    assert cfg.ema is None


@pytest.mark.parametrize("arg, expected_type", [
    ("seed=abc", "int"),
    ("seed=1.5", "int"),
    ("optim.lr=fast", "float"),
    ("compile=maybe", "bool"),
    ("compile=2", "bool"),  # OmegaConf alone reads any non-zero integer as true
    ("window=[0,5,6]", "tuple[int, int] | None"),
    ("sampler.order=3", "Literal"),
    ("reward_weights.judge=high", "float"),  # the entry's type
    ("size=1,2,3", "tuple[int, int]"),
    ("size=a,b", "tuple[int, int]"),
    ("sampler.kind=euler", "Literal"),
    ("optim.clip=big", "float | None"),
])
def test_bad_value_names_key_type_and_value(arg, expected_type):
    key, value = arg.split("=", 1)
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, [arg])
    msg = str(info.value)
    assert repr(key) in msg and expected_type in msg and repr(value) in msg


def test_literal_error_lists_choices():
    with pytest.raises(ConfigError, match="'ode', 'sde', 'cps'"):
        parse_config(TrainConfig, ["sampler.kind=euler"])


def test_bad_value_in_yaml_names_file(tmp_path):
    path = write_yaml(tmp_path / "bad.yaml", {"sampler": {"steps": "many"}})
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path)
    assert "'sampler.steps'" in str(info.value) and "bad.yaml" in str(info.value)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_top_level_key():
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, ["sed=1"])
    msg = str(info.value)
    assert "'sed'" in msg
    for key in ("seed", "run_name", "compile", "optim", "sampler"):
        assert key in msg
    assert "Did you mean 'seed'?" in msg


def test_unknown_nested_key():
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, ["optim.lrr=1"])
    msg = str(info.value)
    assert "'optim.lrr'" in msg
    assert "optim.lr" in msg and "optim.betas" in msg and "optim.clip" in msg
    assert "Did you mean 'optim.lr'?" in msg
    # the valid keys of *that* section, not the top level
    assert "sampler" not in msg


def test_unknown_section_name():
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, ["optm.lr=1"])
    assert "'optm.lr'" in str(info.value) and "Did you mean 'optim'?" in str(info.value)


def test_unknown_key_inside_yaml(tmp_path):
    path = write_yaml(tmp_path / "typo.yaml", {"sampler": {"stepz": 3}})
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, ["--config", str(path)])
    msg = str(info.value)
    assert "'sampler.stepz'" in msg and "sampler.steps" in msg and "sampler.kind" in msg
    assert "typo.yaml" in msg


def test_subkey_of_a_plain_value_is_an_error():
    with pytest.raises(ConfigError, match="'seed.x'"):
        parse_config(TrainConfig, ["seed.x=1"])


def test_section_needs_a_mapping():
    with pytest.raises(ConfigError, match="section"):
        parse_config(TrainConfig, ["optim=3"])


def test_malformed_arguments():
    with pytest.raises(ConfigError, match="key=value"):
        parse_config(TrainConfig, ["seed"])
    with pytest.raises(ConfigError, match="--config"):
        parse_config(TrainConfig, ["--config"])
    with pytest.raises(ConfigError, match="not found"):
        parse_config(TrainConfig, ["--config", "/nonexistent/x.yaml"])


def test_a_key_given_twice_in_one_file_is_refused_naming_its_lines(tmp_path):
    # PyYAML keeps the last: the second optim block replaced the first, whose lr fell back to the default.
    twice = write_yaml(tmp_path / "twice.yaml", "optim:\n  lr: 0.2\nseed: 1\noptim:\n  betas: [0.8, 0.9]\n")
    with pytest.raises(ConfigError, match=r"^config file .*twice.yaml: the key 'optim' is given twice in one "
                                          r"mapping, on lines 1 and 4 \(the second would replace the first\); "
                                          r"give it once$"):
        load_config(TrainConfig, twice)
    inner = write_yaml(tmp_path / "inner.yaml", "optim:\n  lr: 0.2\n  lr: 0.3\n")
    with pytest.raises(ConfigError, match="the key 'lr' is given twice in one mapping, on lines 2 and 3"):
        load_config(TrainConfig, inner)
    both = write_yaml(tmp_path / "both.yaml", "optim:\n  lr: 0.2\noptim.lr: 0.3\n")  # nested and dotted
    with pytest.raises(ConfigError, match=r"config key 'optim.lr' is set twice in .*both.yaml, to 0.2 and 0.3"):
        load_config(TrainConfig, both)
    same = write_yaml(tmp_path / "same.yaml", "optim:\n  lr: 0.2\noptim.lr: 0.2\n")  # agreeing: harmless
    assert load_config(TrainConfig, same).optim.lr == 0.2
    # On the command line the last one wins, as with any CLI.
    assert parse_config(TrainConfig, ["optim.lr=0.2", "optim.lr=0.3"]).optim.lr == 0.3


def test_yaml_must_be_a_mapping(tmp_path):
    path = write_yaml(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(TrainConfig, path)
    empty = write_yaml(tmp_path / "empty.yaml", "")
    assert load_config(TrainConfig, empty) == TrainConfig()


def test_required_fields():
    assert parse_config(RequiredConfig, ["model_path=/w"]).model_path == "/w"
    with pytest.raises(ConfigError, match="model_path"):
        parse_config(RequiredConfig, [])


def test_field_docstrings():
    docs = field_docstrings(TrainConfig)
    assert docs["seed"] == "Seed of torch, numpy and random."
    assert docs["optim"] == "Optimizer settings."
    assert field_docstrings(OptimConfig)["lr"] == "Learning rate of AdamW."


def test_help_lists_every_key_with_type_default_and_doc():
    text = config_help(TrainConfig, prog="train.py")
    assert "usage: train.py" in text
    assert "A tiny training config for the tests." in text
    assert "seed: int = 0" in text
    assert "Seed of torch, numpy and random." in text
    assert "optim.lr: float = 0.0001" in text
    assert "Learning rate of AdamW." in text
    assert "sampler.kind: Literal['ode', 'sde', 'cps'] = 'sde'" in text
    assert "ema.decay: float = 0.99" in text and "EMA decay per step." in text
    for f in dataclasses.fields(TrainConfig):
        assert f.name in text


def test_help_flag_prints_and_exits(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            parse_config(TrainConfig, ["seed=1", flag])
        assert info.value.code == 0
        assert "Learning rate of AdamW." in capsys.readouterr().out


def test_config_to_dict_is_yaml_safe():
    d = config_to_dict(parse_config(TrainConfig, ["ema.decay=0.5"]))
    assert d["size"] == [8, 8] and d["optim"]["betas"] == [0.9, 0.999]
    assert d["out_dir"] == "runs" and d["ema"] == {"decay": 0.5}
    yaml.safe_dump(d)  # raises on anything YAML-unsafe


def test_save_load_round_trip(tmp_path):
    cfg = parse_config(TrainConfig, [
        "seed=3", "run_name=no", "compile=true", "size=4,6", "prompts=[yes, '1', null x]",
        "optim.lr=1e-5", "optim.clip=none", "sampler.kind=cps", "ema.decay=0.9",
        "reward_weights.judge=0.25", "out_dir=/tmp/x",
    ])
    path = save_config(cfg, tmp_path / "config.yaml")
    loaded = load_config(TrainConfig, path)
    assert loaded == cfg
    assert loaded.run_name == "no"  # the string "no", not False: saved quoted
    assert load_config(TrainConfig, save_config(TrainConfig(), tmp_path / "d.yaml")) == TrainConfig()


def test_apply_overrides_returns_new_config():
    cfg = TrainConfig()
    new = apply_overrides(cfg, ["optim.lr=0.1", "prompts=x"])
    assert new.optim.lr == 0.1 and new.prompts == ["x"]
    assert cfg.optim.lr == 1e-4 and cfg.prompts == ["a", "b"]  # untouched
    new2 = apply_overrides(new, {"seed": "5", "sampler": {"steps": 3}, "optim.betas": [0.1, 0.2]})
    assert new2.seed == 5 and new2.sampler.steps == 3 and new2.optim.betas == (0.1, 0.2)
    assert new2.optim.lr == 0.1
    with pytest.raises(ConfigError, match="'optim.nope'"):
        apply_overrides(cfg, {"optim": {"nope": 1}})


def test_non_dataclass_is_rejected():
    with pytest.raises(TypeError):
        parse_config(dict, [])


# ---- what the OmegaConf layer adds or changes ----------------------------------------------


def test_yaml_unquoted_yes_no_for_a_string_is_refused(tmp_path):
    # YAML 1.1 reads `no` as false; stored as the string 'False' the run name would silently change.
    path = write_yaml(tmp_path / "c.yaml", "run_name: no\n")
    with pytest.raises(ConfigError, match=r"'run_name'.*c\.yaml.*quote"):
        load_config(TrainConfig, path)
    with pytest.raises(ConfigError, match="'prompts'"):
        load_config(TrainConfig, write_yaml(tmp_path / "d.yaml", "prompts: [a, yes]\n"))
    assert load_config(TrainConfig, write_yaml(tmp_path / "e.yaml", "run_name: 'no'\n")).run_name == "no"
    # on the command line every scalar is text: the field type decides, so yes/no stay strings
    assert parse_config(TrainConfig, ["run_name=no", "prompts=[yes, on]"]).prompts == ["yes", "on"]


def test_interpolation_of_other_keys():
    # OmegaConf's ${key} interpolation works in values; \${ keeps the text as written.
    cfg = parse_config(TrainConfig, ["run_name=runs/s${seed}-${sampler.kind}", "seed=3"])
    assert cfg.run_name == "runs/s3-sde"
    assert parse_config(TrainConfig, [r"run_name=\${seed}"]).run_name == "${seed}"
    with pytest.raises(ConfigError, match="'run_name'.*nope"):
        parse_config(TrainConfig, ["run_name=${nope}"])


@dataclass
class RangeConfig:
    lo: int = 0
    """Lower bound."""
    hi: int = 1
    """Upper bound."""

    def __post_init__(self):
        if self.lo > self.hi:
            raise ValueError(f"lo ({self.lo}) must be <= hi ({self.hi})")


def test_post_init_check_becomes_a_config_error():
    assert parse_config(RangeConfig, ["lo=1", "hi=2"]) == RangeConfig(1, 2)
    with pytest.raises(ConfigError, match=r"lo \(3\) must be <= hi \(1\)"):
        parse_config(RangeConfig, ["lo=3"])


@dataclass
class SectionWithoutDefault:
    optim: OptimConfig
    """Optimizer settings (no default: required, as for the dataclass itself)."""
    ema: EmaConfig | None
    """EMA (required too; none turns it off)."""


def test_section_without_default_is_required_and_starts_from_its_class_defaults():
    with pytest.raises(ConfigError, match="missing required config keys: ema, optim"):
        parse_config(SectionWithoutDefault, [])
    cfg = parse_config(SectionWithoutDefault, ["optim.lr=0.5", "ema=none"])
    assert cfg.optim == OptimConfig(lr=0.5) and cfg.ema is None


def test_apply_overrides_takes_a_section_instance():
    new = apply_overrides(TrainConfig(), {"optim": OptimConfig(lr=0.3), "ema": EmaConfig(0.5)})
    assert new.optim == OptimConfig(lr=0.3) and new.ema == EmaConfig(0.5)
    assert apply_overrides(new, ["ema=none"]).ema is None
    with pytest.raises(ConfigError, match="'optim'"):
        apply_overrides(TrainConfig(), {"optim": EmaConfig()})


# ---- recipes that share sections: inheritance and recipe-specific section defaults ---------

SHARED = """
from __future__ import annotations
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingConfig:
    sampler: Literal["ode", "sde", "cps"] = "sde"
    \"\"\"Rollout sampler.\"\"\"
    steps: int = 10
    \"\"\"Denoising steps.\"\"\"
    sde_window: tuple[int, int] | None = None
    \"\"\"[start, end) of the stochastic steps.\"\"\"


@dataclass
class RunConfig:
    run_dir: str = "runs/x"
    \"\"\"Where the run goes.\"\"\"
    seed: int = 0
    \"\"\"Seed of everything.\"\"\"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    \"\"\"Rollout sampling.\"\"\"
"""

# Another module, as a recipe under trainers/ is: its annotations name SamplingConfig only
# through the import, and RunConfig's name types (Literal) this module does not import.
RECIPE = """
from __future__ import annotations
from dataclasses import dataclass, field
from {shared} import RunConfig, SamplingConfig


@dataclass
class LossConfig:
    beta: float = 0.1
    \"\"\"KL weight.\"\"\"


@dataclass
class Config(RunConfig):
    \"\"\"A recipe whose rollouts are deterministic by default.\"\"\"

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode", steps=4))
    loss: LossConfig = field(default_factory=LossConfig)
    \"\"\"The recipe's own section.\"\"\"
"""


@pytest.fixture
def recipe(tmp_path, monkeypatch, request):
    shared = f"shared_{request.node.name}"  # a fresh module name per test: no stale import
    (tmp_path / f"{shared}.py").write_text(SHARED)
    (tmp_path / f"recipe_{request.node.name}.py").write_text(RECIPE.format(shared=shared))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(shared), importlib.import_module(f"recipe_{request.node.name}")


def test_recipe_config_inherits_the_shared_fields_and_keeps_its_section_defaults(recipe, tmp_path):
    shared, mod = recipe
    cfg = parse_config(mod.Config, [])
    assert cfg == mod.Config() and isinstance(cfg, shared.RunConfig)
    assert (cfg.run_dir, cfg.seed, cfg.loss.beta) == ("runs/x", 0, 0.1)
    assert (cfg.sampling.sampler, cfg.sampling.steps) == ("ode", 4)  # the recipe's, not the class's
    assert parse_config(shared.RunConfig, []).sampling.sampler == "sde"
    # Setting one key of the section keeps the recipe's other defaults (YAML and CLI alike).
    path = write_yaml(tmp_path / "c.yaml", {"seed": 2, "sampling": {"sde_window": [0, 2]}})
    cfg = parse_config(mod.Config, ["--config", str(path), "loss.beta=0.5"])
    assert cfg.sampling == shared.SamplingConfig(sampler="ode", steps=4, sde_window=(0, 2))
    assert (cfg.seed, cfg.loss.beta) == (2, 0.5)
    assert load_config(mod.Config, save_config(cfg, tmp_path / "config.yaml")) == cfg


def test_recipe_config_errors_and_help_cover_inherited_keys(recipe):
    _, mod = recipe
    with pytest.raises(ConfigError) as info:
        parse_config(mod.Config, ["sed=1"])
    msg = str(info.value)
    assert "Did you mean 'seed'?" in msg and all(k in msg for k in ("run_dir", "seed", "sampling", "loss"))
    with pytest.raises(ConfigError, match="Did you mean 'sampling.sampler'"):
        parse_config(mod.Config, ["sampling.samplr=sde"])
    with pytest.raises(ConfigError, match="'ode', 'sde', 'cps'"):
        parse_config(mod.Config, ["sampling.sampler=euler"])
    text = config_help(mod.Config, prog="recipe.py")
    assert "A recipe whose rollouts are deterministic by default." in text
    assert "seed: int = 0\n      Seed of everything." in text  # inherited field and docstring
    assert "sampling: section SamplingConfig\n      Rollout sampling." in text  # the base's docstring
    assert "sampling.sampler: Literal['ode', 'sde', 'cps'] = 'ode'" in text  # the recipe's default
    assert "sampling.sde_window: tuple[int, int] | None = None" in text
    assert "loss.beta: float = 0.1\n      KL weight." in text


def test_an_unknown_model_card_is_one_plain_line_listing_the_known_ones():
    from trainers.grpo import Config, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, ["model.card=toy-digts"]))
    line = str(err.value).splitlines()[-1].strip()
    assert line.startswith("model.card='toy-digts': unknown model card 'toy-digts'; known cards: ")
    assert "toy-digits, toy-numbers" in line and '"' not in line  # the KeyError's message, not its repr


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory: give a YAML file"):
        parse_config(TrainConfig, ["--config", str(tmp_path)])


def test_the_hint_for_a_bare_word_names_a_real_key():
    with pytest.raises(ConfigError, match=r"e\.g\. train\.learning_rate=3e-4") as err:
        parse_config(TrainConfig, ["steps"])
    assert "optim." not in str(err.value)


def test_a_config_file_that_is_not_utf8_is_one_plain_error(tmp_path):
    path = tmp_path / "utf16.yaml"
    path.write_bytes("steps: 3\n".encode("utf-16"))  # a Windows editor's "Unicode": starts with ff fe
    with pytest.raises(ConfigError, match=r"utf16.yaml is not UTF-8 text \(byte 0xff at offset 0\); a config is "
                                          r"a YAML file saved as UTF-8"):
        parse_config(TrainConfig, ["--config", str(path)])
