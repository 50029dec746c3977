"""Config dataclasses, YAML files and dotted `key=value` command-line overrides.

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
Values are coerced from the field's annotation; an unknown key or a value that
does not fit is a `ConfigError` naming the dotted key and what is valid.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import enum
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from pathlib import Path, PurePath
from collections.abc import Callable
from typing import Any, Literal, Union

import yaml

from flywheel.runs.rundir import atomic_write_text

__all__ = [
    "ConfigError",
    "apply_overrides",
    "config_help",
    "config_to_dict",
    "field_docstrings",
    "load_config",
    "parse_config",
    "save_config",
]

_NoneType = type(None)
_NONE_WORDS = {"none", "null", "~"}
_TRUE_WORDS = {"true", "1", "yes", "y", "on"}
_FALSE_WORDS = {"false", "0", "no", "n", "off"}
_CLI = "command line"


class ConfigError(ValueError):
    """A config file or override that does not fit the config dataclass."""


class _BadValue(Exception):
    """Internal: a value does not fit a type; turned into a ConfigError that names the key."""


# ---------------------------------------------------------------------------
# Introspection of config classes
# ---------------------------------------------------------------------------


def _check_config_class(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type as the config class, got {cls!r}")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config sets: those that go through __init__."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


@functools.lru_cache(maxsize=None)  # resolved once per class, not once per key
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations (from __future__ import annotations)
    # in the class's module; a class whose annotations name locals of a function
    # cannot be resolved, so say so instead of failing obscurely later.
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # NameError, TypeError from odd annotations
        raise ConfigError(
            f"cannot resolve the field types of config class {cls.__qualname__}: {e}. "
            "Define config classes (and the types they name) at module level."
        ) from e


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _section_type(tp: Any) -> tuple[type, bool] | None:
    """(dataclass, optional) when a field of type `tp` is a section, else None."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not _NoneType]
        if len(args) == 1 and len(typing.get_args(tp)) == 2 and isinstance(args[0], type) \
                and dataclasses.is_dataclass(args[0]):
            return args[0], True
    return None


def _is_dict_type(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _type_name(tp: Any) -> str:
    if tp is _NoneType:
        return "None"
    if tp is Any:
        return "Any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[" + ", ".join("..." if a is Ellipsis else _type_name(a) for a in args) + "]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


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
            source = textwrap.dedent(inspect.getsource(klass))
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError):
            continue
        classdef = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        if classdef is None:
            continue
        body = classdef.body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


# ---------------------------------------------------------------------------
# Value coercion
# ---------------------------------------------------------------------------


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS)


# Text from the command line is parsed with YAML's BaseLoader, which keeps every
# scalar a string: `prompts=[yes, 1]` must stay ["yes", "1"] for a list[str], and
# the field type (not YAML 1.1's guesses) decides what the items become.


def _as_mapping(value: Any) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):  # e.g. section={lr: 1e-3} on the command line
        try:
            parsed = yaml.load(value, Loader=yaml.BaseLoader)
        except yaml.YAMLError as e:
            raise _BadValue("not a YAML mapping") from e
        if isinstance(parsed, dict):
            return parsed
    raise _BadValue("expected a mapping")


def _as_sequence(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return []
        if (s[0], s[-1]) in (("[", "]"), ("(", ")")):  # YAML flow list: [1, 2]
            try:
                parsed = yaml.load("[" + s[1:-1] + "]", Loader=yaml.BaseLoader)
            except yaml.YAMLError as e:
                raise _BadValue("not a YAML list") from e
            return list(parsed)
        return [part.strip() for part in s.split(",")]  # plain: 1,2
    raise _BadValue("expected a list")


def _coerce(value: Any, tp: Any) -> Any:
    """Convert `value` (a command-line string or a YAML-typed value) to type `tp`.

    Raises _BadValue (with a reason where a bare "expected <type>" is not enough).
    """
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    if _is_union(tp):
        if _NoneType in args and _is_none(value):
            return None
        for arg in args:  # first alternative that fits, in the order written
            if arg is _NoneType:
                continue
            try:
                return _coerce(value, arg)
            except _BadValue:
                pass
        raise _BadValue()
    if tp is _NoneType:
        if _is_none(value):
            return None
        raise _BadValue()
    if origin is Literal:
        for allowed in args:
            try:
                if _coerce(value, type(allowed)) == allowed:
                    return allowed
            except _BadValue:
                pass
        raise _BadValue("must be one of " + ", ".join(repr(a) for a in args))
    if value is None:
        raise _BadValue()

    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
        raise _BadValue("use true/false, yes/no or 1/0")
    if tp is int:
        if isinstance(value, bool):  # bool is an int subclass; `lr: yes` is a mistake
            raise _BadValue()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
            try:  # "1e3" for a step count
                f = float(value.strip())
            except ValueError:
                raise _BadValue() from None
            if f.is_integer():
                return int(f)
        raise _BadValue()
    if tp is float:
        if isinstance(value, bool):
            raise _BadValue()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` as a string, so parse it here
            try:
                return float(value.strip())
            except ValueError:
                raise _BadValue() from None
        raise _BadValue()
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `name: 2024` in YAML
        raise _BadValue()
    if isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)
        raise _BadValue()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if value == member.value or (isinstance(value, str) and value == member.name):
                return member
        raise _BadValue("must be one of " + ", ".join(m.name for m in tp))

    container = origin or tp
    if container in (list, tuple, set, frozenset):
        items = _as_sequence(value)
        if container is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(items) != len(args):
                raise _BadValue(f"expected {len(args)} items, got {len(items)}")
            return tuple(_coerce(v, a) for v, a in zip(items, args))
        elem = args[0] if args else Any
        return container(_coerce(v, elem) for v in items)
    if container is dict:
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt): _coerce(v, vt) for k, v in _as_mapping(value).items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _BadValue(f"fields of type {_type_name(tp)} are not supported by flywheel.runs.config")


def _coerce_for_key(value: Any, tp: Any, dotted: str, source: str) -> Any:
    try:
        return _coerce(value, tp)
    except _BadValue as e:
        reason = f" ({e})" if str(e) else ""
        raise ConfigError(
            f"bad value for {dotted!r} ({source}): expected {_type_name(tp)}, got {value!r}{reason}"
        ) from None


# ---------------------------------------------------------------------------
# The state: a nested dict of coerced values that becomes the dataclass at the end
# ---------------------------------------------------------------------------
# Working on dicts (not instances) lets a config class have required fields:
# they are simply absent until a YAML file or an override sets them.


def _to_state(value: Any, tp: Any) -> Any:
    if _section_type(tp) is not None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _state_from_instance(value)
    return copy.deepcopy(value)  # the new config must not share lists with the old one


def _state_from_instance(obj: Any) -> dict:
    hints = _hints(type(obj))
    return {name: _to_state(getattr(obj, name), hints[name]) for name in _fields(type(obj))}


def _default_state(cls: type) -> dict:
    hints = _hints(cls)
    state: dict[str, Any] = {}
    for name, f in _fields(cls).items():
        if f.default is not dataclasses.MISSING:
            state[name] = _to_state(f.default, hints[name])
        elif f.default_factory is not dataclasses.MISSING:
            state[name] = _to_state(f.default_factory(), hints[name])
        elif (sec := _section_type(hints[name])) is not None and not sec[1]:
            state[name] = _default_state(sec[0])  # a section without default: its own defaults
        # else: required, absent until set
    return state


def _unknown_key(cls: type, name: str, full_key: str, prefix: str, source: str) -> ConfigError:
    valid = list(_fields(cls))
    where = f"section {prefix[:-1]!r}" if prefix else "the top level"
    msg = (f"unknown config key {full_key!r} ({source}): {name!r} is not a key of {where}. "
           f"Valid keys there: {', '.join(prefix + v for v in valid) or '(none)'}.")
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        msg += f" Did you mean {prefix + close[0]!r}?"
    return ConfigError(msg)


def _set(cls: type, state: dict, parts: list[str], value: Any, prefix: str, source: str,
         full_key: str | None = None) -> None:
    """Set the dotted key `parts` (relative to section `cls` at `prefix`) to `value`."""
    name, rest = parts[0], parts[1:]
    dotted = prefix + name
    full_key = full_key or prefix + ".".join(parts)
    if name not in _fields(cls):
        raise _unknown_key(cls, name, full_key, prefix, source)
    tp = _hints(cls)[name]

    sec = _section_type(tp)
    if sec is not None:
        sec_cls, optional = sec
        if not rest and optional and _is_none(value):
            state[name] = None
            return
        if not rest and isinstance(value, sec_cls):
            state[name] = _state_from_instance(value)
            return
        sub = state.get(name)
        if not isinstance(sub, dict):  # unset, or an optional section that was None
            sub = _default_state(sec_cls)
        if rest:
            _set(sec_cls, sub, rest, value, dotted + ".", source, full_key)
        else:  # a mapping merges into the section, key by key
            try:
                mapping = _as_mapping(value)
            except _BadValue:
                raise ConfigError(
                    f"bad value for {dotted!r} ({source}): it is a section ({sec_cls.__name__}); "
                    f"give a mapping or set its keys as {dotted}.<key>=value, "
                    f"valid keys: {', '.join(_fields(sec_cls))}; got {value!r}"
                ) from None
            for k, v in mapping.items():
                _set(sec_cls, sub, str(k).split("."), v, dotted + ".", source)
        state[name] = sub
        return

    if rest:
        if _is_dict_type(tp):  # weights.clip=0.5 sets one entry of a dict field
            kt, vt = typing.get_args(tp) or (Any, Any)
            entries = dict(state.get(name) or {})
            entry_key = _coerce_for_key(".".join(rest), kt, full_key, source)
            entries[entry_key] = _coerce_for_key(value, vt, full_key, source)
            state[name] = entries
            return
        raise ConfigError(
            f"unknown config key {full_key!r} ({source}): {dotted!r} is a value of type "
            f"{_type_name(tp)}, not a section, so it has no sub-keys"
        )
    state[name] = _coerce_for_key(value, tp, dotted, source)


def _build(cls: type, state: dict, prefix: str, missing: list[str]) -> Any:
    hints = _hints(cls)
    kwargs = {}
    n_missing = len(missing)
    for name in _fields(cls):
        if name not in state:
            missing.append(prefix + name)
            continue
        value = state[name]
        sec = _section_type(hints[name])
        if sec is not None and isinstance(value, dict):
            value = _build(sec[0], value, f"{prefix}{name}.", missing)
        kwargs[name] = value
    if len(missing) > n_missing:
        return None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # a __post_init__ check of the config class
        where = f"section {prefix[:-1]!r}" if prefix else cls.__name__
        raise ConfigError(f"invalid config ({where}): {e}") from e


def _finish(cls: type, state: dict) -> Any:
    missing: list[str] = []
    cfg = _build(cls, state, "", missing)
    if missing:
        raise ConfigError(
            f"missing required config keys: {', '.join(missing)} "
            "(set them in a --config YAML file or as key=value)"
        )
    return cfg


def _apply_yaml(cls: type, state: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if data is None:  # an empty file changes nothing
        return
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    for k, v in data.items():
        # `optim.lr: 1e-3` at the top of a file works like the nested form.
        _set(cls, state, str(k).split("."), v, "", f"in {path}")


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip()
    if key.startswith("--"):  # tolerate --optim.lr=1e-3
        key = key[2:]
    if not sep or not key or any(c.isspace() for c in key) or "" in key.split("."):
        raise ConfigError(
            f"cannot read command-line argument {item!r}: expected key=value or section.key=value "
            "(e.g. optim.lr=3e-4), --config FILE.yaml, or --help"
        )
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

    config_files: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML file path after it: --config FILE.yaml")
            config_files.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            config_files.append(arg[len("--config="):])
        else:
            overrides.append(arg)
        i += 1

    state = _default_state(cls)
    for path in config_files:
        _apply_yaml(cls, state, path)
    for item in overrides:
        key, value = _split_override(item)
        _set(cls, state, key.split("."), value, "", _CLI)
    return _finish(cls, state)


def apply_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> Any:
    """A new config: `cfg` with overrides applied (["a.b=1", ...] or {"a.b": 1, "c": {...}}).

    `cfg` itself is not modified. Values are coerced and checked like
    command-line ones; a nested mapping merges into its section.
    """
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"apply_overrides expects a config dataclass instance, got {type(cfg).__name__}")
    cls = type(cfg)
    state = _state_from_instance(cfg)
    if isinstance(overrides, dict):
        for key, value in overrides.items():
            _set(cls, state, str(key).split("."), value, "", "overrides")
    else:
        for item in overrides:
            key, value = _split_override(item)
            _set(cls, state, key.split("."), value, "", "overrides")
    return _finish(cls, state)


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
    state = _default_state(cls)
    _apply_yaml(cls, state, path)
    return _finish(cls, state)


def _raw_annotation(cls: type, name: str) -> str | None:
    """The annotation as written in the source (a string under postponed evaluation)."""
    for klass in cls.__mro__:
        ann = klass.__dict__.get("__annotations__", {})
        if name in ann:
            return ann[name] if isinstance(ann[name], str) else None
    return None


def _help_lines(cls: type, state: dict, prefix: str, lines: list[str]) -> None:
    hints = _hints(cls)
    docs = field_docstrings(cls)
    for name in _fields(cls):
        tp = hints[name]
        type_str = _raw_annotation(cls, name) or _type_name(tp)
        sec = _section_type(tp)
        value = state.get(name, dataclasses.MISSING)
        if sec is not None and (isinstance(value, dict) or value is dataclasses.MISSING):
            lines.append(f"  {prefix}{name}: section {type_str}")
        else:
            default = "(required)" if value is dataclasses.MISSING else \
                f"= {str(value) if isinstance(value, PurePath) else repr(value)}"
            lines.append(f"  {prefix}{name}: {type_str} {default}")
        if docs.get(name):
            lines.append(f"      {docs[name]}")
        if sec is not None:
            sub = value if isinstance(value, dict) else _default_state(sec[0])
            _help_lines(sec[0], sub, f"{prefix}{name}.", lines)


def config_help(cls: type, prog: str | None = None) -> str:
    """Help text: usage, then every dotted key with its type, default and docstring."""
    _check_config_class(cls)
    prog = prog or os.path.basename(sys.argv[0]) or "prog"
    lines = [
        f"usage: {prog} [--config FILE.yaml ...] [key=value ...] [section.key=value ...]",
        "",
        "Precedence: defaults < --config YAML files (in order) < key=value overrides.",
        "Lists: a,b or [a, b]. Optional values: none. Booleans: true/false.",
        "",
    ]
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(cls.__name__ + "("):  # skip dataclass's generated signature
        lines += [doc.splitlines()[0], ""]
    lines.append(f"{cls.__name__} keys:")
    _help_lines(cls, _default_state(cls), "", lines)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Validation: every field checked before a run does any work
# ---------------------------------------------------------------------------


def config_value(cfg: Any, key: str) -> Any:
    """The value at a dotted key of a config dataclass ("train.learning_rate")."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def non_finite_fields(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every float field (or float inside a tuple/list field) that is NaN or inf."""
    bad = []
    for name in _fields(type(cfg)):
        value, key = getattr(cfg, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            bad += non_finite_fields(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
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
        self.problems = [f"{key}={config_value(cfg, key)}: must be a finite number" for key in self._non_finite]

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
