"""Config dataclasses, YAML files and dotted `key=value` command-line overrides, on OmegaConf.

A config is a dataclass whose every field has a one-line docstring on the line
after it (cleanrl style); a field whose type is itself a dataclass is a
section, addressed with dotted keys:

    @dataclass
    class OptimConfig:
        lr: float = 1e-4
        '''Learning rate of AdamW.'''

    @dataclass
    class TrainConfig:
        seed: int = 0
        '''Seed of torch, numpy and random.'''
        optim: OptimConfig = field(default_factory=OptimConfig)
        '''Optimizer settings.'''

    cfg = parse_config(TrainConfig, sys.argv[1:])
    # python train.py --config configs/x.yaml optim.lr=3e-4 seed=1

Precedence: dataclass defaults < YAML files (in the order given) < key=value.
A recipe's Config may inherit shared fields from a base dataclass, and a
section's default_factory may give that recipe's own defaults for the section.
Values may use OmegaConf's interpolation, `run_dir=runs/seed${seed}` (a
backslash before `${` keeps the text as written); `???` marks a key to be set.

OmegaConf structured configs do the typing: `OmegaConf.structured` builds the
defaults (inherited fields and default_factory sections included),
`OmegaConf.update` converts and checks each value against its annotation (int,
float, bool, str, Path, Enum, Literal, X | None, tuple, list, dict, sections)
and `OmegaConf.to_object` builds the dataclasses (running __post_init__). This
module is the thin layer around it: it walks dotted keys so that an unknown one
is named with the valid keys of its section and the closest one, fills the few
gaps listed at `_prepare`, and turns OmegaConf's errors into `ConfigError`s
that name the key, the value, the expected type and where the value came from.
A key the class lacks that is an old name of one it has (flywheel/config/aliases.py) is set under its new
name, with a warning; an old name and its new one set to different values in one source is an error.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any, Literal, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flywheel.config.aliases import ALIASES, KeySource, alias_of, warn_renamed
from flywheel.runs.rundir import atomic_write_text

__all__ = [
    "CONFIG_RELATIVE", "ConfigError", "RESUME_HISTORY_KEY", "apply_config_files", "apply_overrides", "config_help",
    "config_to_dict", "field_docstrings", "load_config", "parse_config", "resolve_config", "save_config",
    "split_argv",
]

# The top-level key of a run's config.yaml under which resumes record the keys they changed
# (flywheel/runs/resume.py); reading a config skips it.
RESUME_HISTORY_KEY = "resume_overrides"

_NoneType = type(None)
_NONE_WORDS = {"none", "null", "~"}
_CLI = "command line"


# Field metadata: a relative path given in a YAML file that does not exist from the working directory is read
# relative to that file's folder (`data.prompts: prompts.txt` in configs/x.yaml -> configs/prompts.txt). Values
# from the command line are relative to the working directory only. The resolved path is the value kept.
CONFIG_RELATIVE = "config_relative"


class ConfigError(ValueError):
    """A config file or override that does not fit the config dataclass."""


class _BadValue(Exception):
    """Internal: a value does not fit a type; turned into a ConfigError that names the key."""


# ---------------------------------------------------------------------------
# Introspection of config classes: what the messages and --help need
# ---------------------------------------------------------------------------


def _check_config_class(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type as the config class, got {cls!r}")


def _fields(cls: type) -> list[str]:
    """The keys a config sets: the fields that go through __init__ (inherited ones first)."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    # String annotations (from __future__ import annotations) resolve in the class's module;
    # names local to a function do not, so say so instead of failing obscurely later.
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # NameError, TypeError from odd annotations
        raise ConfigError(f"cannot resolve the field types of config class {cls.__qualname__}: {e}. "
                          "Define config classes (and the types they name) at module level.") from e


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _section_type(tp: Any) -> tuple[type, bool] | None:
    """(dataclass, optional) when a field of type `tp` is a section, else None."""
    args = [a for a in typing.get_args(tp) if a is not _NoneType] if _is_union(tp) else [tp]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0], args[0] is not tp
    return None


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is _NoneType:
        return "None"
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[" + ", ".join("..." if a is Ellipsis else _type_name(a) for a in args) + "]"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: docstring} from the string literal on the line after each field.

    Read from the class source with `ast`, since Python keeps no trace of these
    literals at run time. Base dataclasses are read too (a subclass wins).
    Classes whose source is unavailable (e.g. defined in a REPL) give {}.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        classdef = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        body = classdef.body if classdef else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


# ---------------------------------------------------------------------------
# Values: what OmegaConf does not do by itself
# ---------------------------------------------------------------------------


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS)


# Command-line text is never YAML-parsed as a whole: OmegaConf's dotlist reads each value
# with a YAML 1.1 loader, which made `run_name=no` the string 'False' and `prompts=[yes]`
# ['True'] (checked with omegaconf 2.4.0), and chokes on a plain string such as `*x`.
# Only a field that wants a list or a mapping parses its text, with YAML's BaseLoader,
# which keeps every scalar a string so the field type decides what the items become.


def _yaml_text(text: str) -> Any:
    try:
        return yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError as e:
        raise _BadValue(f"not valid YAML: {' '.join(str(e).split())}") from None


def _as_sequence(text: str) -> list:
    """`a,b`, `[a, b]` or `(a, b)` as a list of strings; the empty string is the empty list."""
    s = text.strip()
    if not s:
        return []
    if (s[0], s[-1]) in (("[", "]"), ("(", ")")):
        return list(_yaml_text("[" + s[1:-1] + "]"))
    return [part.strip() for part in s.split(",")]


def _prepare(value: Any, tp: Any) -> Any:
    """`value` in a form OmegaConf converts to `tp` as meant; OmegaConf checks the rest.

    Each case is one that omegaconf 2.4.0 gets wrong or refuses (checked):
    `none` for an optional value (it knows only null and ~, and keeps `none` a
    string); comma lists such as `size=16,32` (a list or tuple field refuses any
    string); `1e3` or `1000.0` for an int (IntegerNode refuses both); `2` for a
    Literal[1, 2] (LiteralNode compares the text '2' with 2); `2` or `-1` for a
    bool (BooleanNode takes any non-zero integer as true); and a YAML file's
    unquoted yes/no, which YAML 1.1 reads as booleans and StringNode would keep
    as 'True'/'False' without a word.
    """
    if _is_union(tp):
        options = [a for a in typing.get_args(tp) if a is not _NoneType]
        if len(options) < len(typing.get_args(tp)) and _is_none(value):
            return None
        return _prepare(value, options[0]) if len(options) == 1 else value
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin in (list, tuple):
        items = _as_sequence(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            return value
        if origin is tuple and args and args[-1] is not Ellipsis:
            # A wrong length is left for OmegaConf to name.
            return [_prepare(v, a) for v, a in zip(items, args)] if len(items) == len(args) else list(items)
        return [_prepare(v, args[0] if args else Any) for v in items]
    if origin is dict:
        mapping = _yaml_text(value) if isinstance(value, str) else value
        if isinstance(mapping, Mapping) and args:
            return {k: _prepare(v, args[1]) for k, v in mapping.items()}
        return mapping
    if origin is Literal and isinstance(value, str):
        return next((choice for choice in args if str(choice) == value.strip()), value)
    if tp is bool and str(value).strip().lstrip("+-").isdigit() and str(value).strip() not in ("0", "1"):
        raise _BadValue("use true/false, yes/no, on/off or 1/0")
    if tp is str and isinstance(value, bool):
        raise _BadValue("YAML reads unquoted yes/no/on/off/true/false as booleans: quote the string")
    if tp is int and isinstance(value, (str, float)):
        return _integral(value)
    return value


def _integral(value: str | float) -> int | str | float:
    """`12`, `1e3`, `1000.0` or 1000.0 as an int; anything else unchanged, for OmegaConf to refuse."""
    if isinstance(value, str):
        try:
            return int(value)  # exact, where float() would round a long one
        except ValueError:
            pass
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() else value


# ---------------------------------------------------------------------------
# Walking dotted keys into the OmegaConf tree
# ---------------------------------------------------------------------------


def _unknown_key(cls: type, name: str, full_key: str, prefix: str, source: str) -> ConfigError:
    valid = _fields(cls)
    where = f"section {prefix[:-1]!r}" if prefix else "the top level"
    msg = (f"unknown config key {full_key!r} ({source}): {name!r} is not a key of {where}. "
           f"Valid keys there: {', '.join(prefix + v for v in valid) or '(none)'}.")
    close = difflib.get_close_matches(name, valid, n=1)
    return ConfigError(msg + (f" Did you mean {prefix + close[0]!r}?" if close else ""))


def _update(root: DictConfig, path: str, value: Any, tp: Any, source: str, key: str) -> None:
    """OmegaConf.update (OmegaConf 2.4 deprecates converting item assignment) with errors that name `key`."""
    try:
        OmegaConf.update(root, path, _prepare(value, tp), merge=False)
    except (_BadValue, OmegaConfBaseException) as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        # OmegaConf's bare "could not be converted" says no more than our message (and in a list
        # it is a template left unfilled); its other reasons (choices, lengths) are kept.
        if reason.startswith(("Value '", "Cannot assign")):
            reason = ""
        raise ConfigError(f"bad value for {key!r} ({source}): expected {_type_name(tp)}, got {value!r}"
                          + (f" ({reason})" if reason else "")) from None


def _relative_to_file(cls: type, name: str, value: Any, base_dir: Path | None) -> Any:
    """A CONFIG_RELATIVE field's relative path from a YAML file: kept when it exists from the working directory,
    else the file's folder joined to it when it exists there (else kept, for the field's own check to name)."""
    if base_dir is None or not isinstance(value, str) or not value.strip():
        return value
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if not field.metadata.get(CONFIG_RELATIVE) or Path(value).is_absolute() or Path(value).exists():
        return value
    beside = base_dir / value
    return str(beside) if beside.exists() else value


def _has_key(cls: type, dotted: str) -> bool:
    """Whether dotted key `dotted` is a field of `cls` (through its sections)."""
    for i, name in enumerate(parts := dotted.split(".")):
        if name not in _fields(cls):
            return False
        section = _section_type(_hints(cls)[name])
        if section is None:
            return i == len(parts) - 1
        cls = section[0]
    return True


class _Keys(KeySource):
    """One source's keys, and the config class whose old key names (flywheel/config/aliases.py) it renames."""

    def __init__(self, cls: type, source: str, once: bool = False):
        super().__init__(source, once=once)
        self.cls = cls


def _assign(root: DictConfig, cls: type, parts: list[str], value: Any, source: str, prefix: str = "",
            full_key: str | None = None, base_dir: Path | None = None, keys: _Keys | None = None,
            given: str | None = None) -> None:
    """Set the dotted key `parts` (relative to section `cls` at `prefix`) to `value`; `base_dir`: the folder of
    the YAML file it comes from (see CONFIG_RELATIVE); `keys`: the source's keys so far (old names renamed,
    conflicts refused), `given`: the old name a renamed key was given as."""
    name, rest = parts[0], parts[1:]
    key, full_key = prefix + name, full_key or prefix + ".".join(parts)
    if name not in _fields(cls):
        renamed = keys and alias_of(prefix + ".".join(parts), lambda k: _has_key(keys.cls, k))
        if renamed:
            old, new = renamed
            warn_renamed(old, ALIASES[old], source)
            return _assign(root, keys.cls, new.split("."), value, source, base_dir=base_dir, keys=keys,
                           given=(given or prefix + ".".join(parts)))
        raise _unknown_key(cls, name, full_key, prefix, source)
    tp = _hints(cls)[name]
    section = _section_type(tp)
    if section is None:
        if keys is not None:
            keys.record(full_key, given or full_key, value)
        if not rest:
            return _update(root, key, _relative_to_file(cls, name, value, base_dir), tp, source, key)
        dict_tp = next((a for a in (typing.get_args(tp) if _is_union(tp) else [tp])
                        if (typing.get_origin(a) or a) is dict), None)
        if dict_tp is None:
            raise ConfigError(f"unknown config key {full_key!r} ({source}): {key!r} is a value of type "
                              f"{_type_name(tp)}, not a section, so it has no sub-keys")
        # weights.judge=0.5 sets one entry of a dict field, keeping the others (`\.`: a dot in the entry)
        entry_tp = (typing.get_args(dict_tp) or (Any, Any))[1]
        return _update(root, f"{key}." + "\\.".join(rest), value, entry_tp, source, full_key)
    sec_cls, optional = section
    if not rest and ((optional and _is_none(value)) or isinstance(value, sec_cls)):
        return _update(root, key, value, tp, source, key)  # off (None), or a whole section given as an instance
    if rest:
        items = [(rest, value)]
    else:  # a mapping merges into the section, key by key
        mapping = value
        if isinstance(value, str):
            try:
                mapping = _yaml_text(value)
            except _BadValue:
                pass
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"bad value for {key!r} ({source}): it is a section ({sec_cls.__name__}); give a "
                              f"mapping or set its keys as {key}.<key>=value, valid keys: "
                              f"{', '.join(_fields(sec_cls))}; got {value!r}")
        items = [(str(k).split("."), v) for k, v in mapping.items()]
    if OmegaConf.is_missing(root, key) or OmegaConf.select(root, key) is None:
        # A section that is off (None) or required and unset: its keys start from its class defaults
        # (OmegaConf refuses to set a key under None, and fails on one under a missing section).
        _update(root, key, OmegaConf.structured(sec_cls), tp, source, key)
    for sub_parts, sub_value in items:
        sub_given = f"{given}.{'.'.join(sub_parts)}" if given and not rest else given
        _assign(root, sec_cls, sub_parts, sub_value, source, key + ".", full_key if rest else None, base_dir,
                keys, sub_given)


def _base(config: Any) -> DictConfig:
    """The OmegaConf tree of a config class's defaults, or of a config instance."""
    cls = config if isinstance(config, type) else type(config)
    _hints(cls)  # our message for annotations that do not resolve, before OmegaConf's
    try:
        return OmegaConf.structured(config)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config class {cls.__qualname__} cannot be typed by OmegaConf: "
                          f"{str(e).splitlines()[0]}") from e


def _finish(root: DictConfig) -> Any:
    """The config dataclass of a finished tree: every required key set, interpolations resolved."""
    try:
        missing = sorted(OmegaConf.missing_keys(root))
        if not missing:
            return OmegaConf.to_object(root)
    except (ValueError, OmegaConfBaseException) as e:  # a __post_init__ check, or a bad ${interpolation}
        where = f" at {e.full_key!r}" if getattr(e, "full_key", None) else ""
        raise ConfigError(f"invalid config{where}: {str(e).splitlines()[0]}") from e
    raise ConfigError(f"missing required config keys: {', '.join(missing)} "
                      "(set them in a --config YAML file or as key=value)")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last,
    so a second `train:` block would replace the first whole and its keys fall back to their defaults."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: PyYAML's own error says so below
                    continue
                if first != key_node.start_mark.line:
                    raise _DuplicateKey(f"the key {key!r} is given twice in one mapping, on lines {first + 1} and "
                                        f"{key_node.start_mark.line + 1} (the second would replace the first); give "
                                        f"it once")
        return super().construct_mapping(node, deep)


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping of a config file (a one-line message, without PyYAML's marks)."""


def _apply_yaml(root: DictConfig, cls: type, path: str | os.PathLike) -> None:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give a YAML file (e.g. configs/toy_numbers_grpo.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); a config is a YAML file saved as UTF-8") from None
    except OSError as e:  # unreadable (permissions, a FIFO that errors, an I/O error)
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    keys = _Keys(cls, f"in {path}", once=True)
    for k, v in (data or {}).items():  # `optim.lr: 1e-3` at the top of a file works like the nested form
        if k == RESUME_HISTORY_KEY:  # a run's record of what its resumes changed, not a setting
            continue
        _assign(root, cls, str(k).split("."), v, keys.source, base_dir=path.parent, keys=keys)


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().removeprefix("--")  # tolerate --optim.lr=1e-3
    if not sep or not key or any(c.isspace() for c in key) or "" in key.split("."):
        raise ConfigError(f"cannot read command-line argument {item!r}: expected key=value or section.key=value "
                          "(e.g. train.learning_rate=3e-4), --config FILE.yaml, or --help")
    return key, value


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def parse_config(cls: type, argv: list[str] | None = None, prog: str | None = None) -> Any:
    """Build a `cls` from defaults, `--config FILE.yaml` files, then key=value overrides.

    `argv` excludes the program name (default: sys.argv[1:]). `--config` may be
    given several times (files apply in order) and as `--config=FILE`. With
    `-h`/`--help` anywhere, prints `config_help(cls)` and exits with status 0.
    """
    _check_config_class(cls)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(cls, prog))
        sys.exit(0)
    config_files, overrides = split_argv(argv)
    root = _base(cls)
    for path in config_files:
        _apply_yaml(root, cls, path)
    keys = _Keys(cls, _CLI)
    for item in overrides:
        key, value = _split_override(item)
        _assign(root, cls, key.split("."), value, _CLI, keys=keys)
    return _finish(root)


def resolve_config(config_class: type, argv: list[str], recipe: str | None = None):
    """A recipe's config from its command line; with resume=RUN, the run's saved config.yaml is the base, and the
    CLI's keys that differ from it must be ones a resume may change (flywheel/runs/resume.py); `recipe` must be
    the run's."""
    cfg = parse_config(config_class, argv)
    if cfg.resume:
        from flywheel.runs.resume import resume_config  # it parses with this module: imported when resuming

        if cfg.overwrite:
            raise ConfigError("resume= continues a run and overwrite=true deletes one: give only one of them")
        # The newest checkpoint that verifies (a corrupt newer one is skipped with a warning);
        # a run dir without its config.yaml is refused rather than resumed with defaults.
        cfg = resume_config(config_class, argv, cfg.resume, recipe)
    return cfg


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the `--config FILE` paths, the key=value overrides) of a command line, each in its order."""
    config_files, overrides = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise ConfigError("--config needs a YAML file path after it: --config FILE.yaml")
            config_files.append(path)
        elif arg.startswith("--config="):
            config_files.append(arg.removeprefix("--config="))
        else:
            overrides.append(arg)
    return config_files, overrides


def apply_config_files(cfg: Any, config_files: list[str]) -> Any:
    """A new config: `cfg` with the keys of each YAML file applied in order (as `parse_config` applies them)."""
    root = _base(cfg)
    for path in config_files:
        _apply_yaml(root, type(cfg), path)
    return _finish(root)


def apply_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> Any:
    """A new config: `cfg` with overrides applied (["a.b=1", ...] or {"a.b": 1, "c": {...}}).

    `cfg` itself is not modified. Values are coerced and checked like
    command-line ones; a nested mapping merges into its section.
    """
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"apply_overrides expects a config dataclass instance, got {type(cfg).__name__}")
    root = _base(cfg)
    pairs = overrides.items() if isinstance(overrides, dict) else map(_split_override, overrides)
    keys = _Keys(type(cfg), "overrides")
    for key, value in pairs:
        _assign(root, type(cfg), str(key).split("."), value, keys.source, keys=keys)
    return _finish(root)


def _plain(value: Any, key: str) -> Any:
    """A YAML-safe copy of a config value: tuples -> lists, Paths -> str, Enums -> value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {n: _plain(getattr(value, n), f"{key}.{n}") for n in _fields(type(value))}
    if isinstance(value, enum.Enum):
        return _plain(value.value, key)
    if isinstance(value, PurePath):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) else str(k): _plain(v, f"{key}.{k}")
                for k, v in value.items()}
    raise ConfigError(f"config value {key!r} of type {type(value).__name__} cannot be written to YAML")


def config_to_dict(cfg: Any) -> dict:
    """The config as a nested dict of YAML-safe values (sections are dicts, tuples lists)."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"config_to_dict expects a config dataclass instance, got {type(cfg).__name__}")
    return _plain(cfg, type(cfg).__name__)


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the config (dataclass or dict) as YAML at `path`, atomically."""
    data = cfg if isinstance(cfg, dict) else config_to_dict(cfg)
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def load_config(cls: type, path: str | os.PathLike) -> Any:
    """Read a YAML file (e.g. a run's config.yaml) on top of `cls`'s defaults."""
    _check_config_class(cls)
    root = _base(cls)
    _apply_yaml(root, cls, path)
    return _finish(root)


def _raw_annotation(cls: type, name: str) -> str | None:
    """The annotation as written in the source (a string under postponed evaluation)."""
    for klass in cls.__mro__:
        ann = klass.__dict__.get("__annotations__", {})
        if name in ann:
            return ann[name] if isinstance(ann[name], str) else None
    return None


def _help_lines(cls: type, node: DictConfig, prefix: str, lines: list[str]) -> None:
    docs = field_docstrings(cls)
    for name in _fields(cls):
        tp = _hints(cls)[name]
        type_str, section = _raw_annotation(cls, name) or _type_name(tp), _section_type(tp)
        missing = OmegaConf.is_missing(node, name)
        value = None if missing else node[name]
        if section is not None and (missing or value is not None):
            lines.append(f"  {prefix}{name}: section {type_str}" + (" (required)" if missing else ""))
        elif missing:
            lines.append(f"  {prefix}{name}: {type_str} (required)")
        else:
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            lines.append(f"  {prefix}{name}: {type_str} = {str(value) if isinstance(value, PurePath) else repr(value)}")
        if docs.get(name):
            lines.append(f"      {docs[name]}")
        if section is not None:  # the section's own defaults (the recipe's, from its default_factory)
            sub = value if isinstance(value, DictConfig) else OmegaConf.structured(section[0])
            _help_lines(section[0], sub, f"{prefix}{name}.", lines)


def config_help(cls: type, prog: str | None = None) -> str:
    """Help text: usage, then every dotted key with its type, default and docstring."""
    _check_config_class(cls)
    prog = prog or os.path.basename(sys.argv[0]) or "prog"
    lines = [
        f"usage: {prog} [--config FILE.yaml ...] [key=value ...] [section.key=value ...]",
        "",
        "Precedence: defaults < --config YAML files (in order) < key=value overrides.",
        "Lists: a,b or [a, b]. Optional values: none. Booleans: true/false. Another key's value: ${key}.",
        "",
    ]
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(cls.__name__ + "("):  # skip dataclass's generated signature
        lines += [doc.splitlines()[0], ""]
    lines.append(f"{cls.__name__} keys:")
    _help_lines(cls, _base(cls), "", lines)
    return "\n".join(lines) + "\n"
