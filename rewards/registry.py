"""Reward registry: scorer factories by name, and parsing of reward specs like "a:1.0,b:0.1".

Scorers are found by name in three places: the built-ins registered below; scorers that
installed packages declare under the entry-point group `flywheel.rewards` (found on the first
lookup of a name that is not registered, and listed by `available()`); and modules named in
the config (`reward.modules`, `python -m rewards.serve --module`) that call `register` when
imported. A plugin may not take a built-in's (or an explicitly registered scorer's) name: the
registered one wins and the plugin is skipped with a warning naming its package, so
installing a package never changes what an existing config computes. A name declared by two
installed packages is an error when it is used, naming both.

    # pyproject.toml of a plugin package
    [project.entry-points."flywheel.rewards"]
    half = "my_pkg.scorers:Half"      # a class or function: called with the scorer's arguments
"""

from __future__ import annotations

import importlib
import inspect
import math
import types
import typing
import warnings
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable

from rewards.types import Scorer, is_differentiable

ScorerFactory = Callable[..., Scorer]
ENTRY_POINT_GROUP = "flywheel.rewards"

_FACTORIES: dict[str, ScorerFactory] = {}
_PLUGINS: dict[str, list[EntryPoint]] = {}  # entry-point name -> its entry points (more than one: ambiguous)
_plugins_found = False


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip() or any(c in name for c in ",:= \t"):
        raise ValueError(f"scorer name {name!r} is not valid: use a non-empty name without ',', ':', '=' or spaces")


def register(name: str, factory: ScorerFactory | None = None, *, replace: bool = False):
    """Register a scorer factory under `name`; without `factory`, returns a decorator."""
    _check_name(name)

    def _add(f: ScorerFactory) -> ScorerFactory:
        if not callable(f):
            raise TypeError(f"factory for {name!r} must be callable, got {type(f).__name__}")
        # Re-registering the same object is harmless (module reloads); a different one is a clash.
        if name in _FACTORIES and _FACTORIES[name] is not f and not replace:
            raise ValueError(f"scorer {name!r} is already registered; pass replace=True to override it")
        _FACTORIES[name] = f
        return f

    return _add if factory is None else _add(factory)


def unregister(name: str) -> None:
    """Remove a registered scorer (plugins and tests that register temporary ones)."""
    _FACTORIES.pop(name, None)


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"package {dist.name!r}" if dist is not None else "an unnamed package"


def find_plugins(refresh: bool = False) -> dict[str, list[EntryPoint]]:
    """The `flywheel.rewards` entry points of the installed packages, by name (read once; `refresh` re-reads
    them, e.g. after sys.path changed). A name taken by a registered scorer is skipped with a warning."""
    global _plugins_found
    if _plugins_found and not refresh:
        return _PLUGINS
    _PLUGINS.clear()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            _check_name(ep.name)
        except ValueError as exc:
            warnings.warn(f"{ENTRY_POINT_GROUP} entry point {ep.value!r} of {_distribution(ep)} is skipped: {exc}",
                          stacklevel=2)
            continue
        if ep.name in _FACTORIES and not getattr(_FACTORIES[ep.name], "entry_point", None):
            warnings.warn(f"{ENTRY_POINT_GROUP} entry point {ep.name!r} ({ep.value}) of {_distribution(ep)} is "
                          f"skipped: {ep.name!r} is already a registered scorer, which keeps that name; the "
                          f"package must use another name", stacklevel=2)
            continue
        if any(e.value == ep.value for e in _PLUGINS.get(ep.name, [])):
            continue  # one package seen twice on sys.path
        _PLUGINS.setdefault(ep.name, []).append(ep)
    _plugins_found = True
    return _PLUGINS


def _plugin_factory(name: str) -> ScorerFactory | None:
    """The factory of the installed plugin `name` (registered on first use), or None."""
    eps = find_plugins().get(name)
    if not eps:
        return None
    if len(eps) > 1:
        raise ValueError(f"scorer {name!r} is declared under {ENTRY_POINT_GROUP} by more than one package: "
                         + "; ".join(f"{_distribution(e)} ({e.value})" for e in eps)
                         + ". Uninstall one of them")
    ep = eps[0]
    try:
        target = ep.load()
    except Exception as exc:
        raise ImportError(f"scorer {name!r}: cannot load entry point {ep.value!r} of {_distribution(ep)} "
                          f"({ENTRY_POINT_GROUP}): {type(exc).__name__}: {exc}") from exc
    if not callable(target):
        raise TypeError(f"scorer {name!r}: entry point {ep.value!r} of {_distribution(ep)} is a "
                        f"{type(target).__name__}, not a scorer class or function")

    def factory(**kwargs: Any) -> Scorer:
        return target(**kwargs)

    factory.target = lambda: target
    factory.entry_point = ep
    factory.__qualname__ = f"plugin({ep.value})"
    return register(name, factory)


def available() -> list[str]:
    """Names of all scorers: registered ones and installed plugins (`flywheel.rewards`), sorted."""
    return sorted(set(_FACTORIES) | set(find_plugins()))


def import_modules(modules: list[str] | tuple[str, ...], key: str = "reward.modules") -> None:
    """Import each module (which registers its scorers with `register`); an ImportError naming `key` and the
    module that failed."""
    for module in modules:
        if not isinstance(module, str) or not module.strip():
            raise ImportError(f"{key}: {module!r} is not a module name; expected e.g. my_pkg.scorers")
        try:
            importlib.import_module(module.strip())
        except Exception as exc:
            raise ImportError(f"{key}: cannot import {module!r} ({type(exc).__name__}: {exc}); it must be "
                              "importable here (installed, or on PYTHONPATH)") from exc


REMOTE = "remote:"  # "remote:<url>" names a scorer served by `python -m rewards.serve` at that address


def factory_of(name: str) -> ScorerFactory:
    """The factory that `get(name)` calls (registered, or an installed plugin); KeyError naming the known ones."""
    factory = _FACTORIES.get(name) or _plugin_factory(name)
    if factory is None:
        raise KeyError(f"unknown scorer {name!r}; known scorers: {', '.join(available()) or '(none)'} (a scorer "
                       f"of another package is found when it is installed under the entry-point group "
                       f"{ENTRY_POINT_GROUP!r}, or when its module is listed in reward.modules)")
    return factory


def get(name: str, **kwargs: Any) -> Scorer:
    """Construct the scorer registered as `name` (or the client of `remote:<url>`), passing `kwargs`."""
    if name.startswith(REMOTE):
        from rewards.remote import RemoteScorer

        return RemoteScorer(name[len(REMOTE):], **kwargs)
    return factory_of(name)(**kwargs)


def _weight(value: Any, where: str) -> float:
    """A finite float weight; `where` names the spec entry for the error message."""
    if value is None:  # YAML `name:` with nothing after it: same as a bare name.
        return 1.0
    if isinstance(value, bool):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: expected a number")
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: expected a number") from None
    if not math.isfinite(w):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: must be finite")
    return w


def _name(value: Any, where: str) -> str:
    """A stripped, non-empty scorer name."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"reward spec entry {where!r} needs a non-empty scorer name, got {value!r}")
    return value.strip()


def _split_remote(text: str) -> tuple[str, float]:
    """A "remote:<url>[:weight]" entry: the weight is a trailing ":<number>" after the URL's port.

    "remote:http://h:8100" has no weight (8100 is the port); "remote:http://h:8100:0.5"
    and "remote:http://h:8100/score:0.5" have weight 0.5. A URL without an explicit port
    cannot carry a weight in a string spec; use the dict/YAML form {"remote:http://h": 0.5}.
    """
    from urllib.parse import urlsplit

    entry = text.strip()
    head, sep, tail = entry.rpartition(":")
    try:
        # A trailing ":number" inside the path (".../score:0.5") is a weight too: paths have no colons here.
        whole_is_url = ":" not in urlsplit(entry[len(REMOTE):]).path
        urlsplit(entry[len(REMOTE):]).port  # noqa: B018
    except ValueError:
        whole_is_url = False
    if sep and not whole_is_url and head != REMOTE.rstrip(":"):
        return head, _weight(tail.strip(), entry)
    if entry == REMOTE or "//" not in entry:
        raise ValueError(f"reward spec entry {entry!r} needs an address: 'remote:http://host:port[:weight]'")
    return entry, 1.0


def _short_name(text: str) -> tuple[str | None, str]:
    """(short name, entry) of a "name=remote:<url>[:weight]" entry; (None, entry) for any other entry."""
    entry = text.strip()
    head, sep, rest = entry.partition("=")
    if not sep or entry.startswith(REMOTE) or ":" in head:  # "=" inside a URL's query belongs to the URL
        return None, entry
    if not rest.strip().startswith(REMOTE):
        raise ValueError(f"reward spec entry {entry!r}: a short name ('name=') is only for remote scorers, e.g. "
                         "'ocr=remote:http://127.0.0.1:8100[:weight]'; other scorers are named by their name")
    try:
        _check_name(head.strip())
    except ValueError as exc:
        raise ValueError(f"reward spec entry {entry!r}: {exc}") from None
    return head.strip(), rest.strip()


def _parse_entry(text: str) -> tuple[str, str, float]:
    """One "name[:weight]", "remote:<url>[:weight]" or "short=remote:<url>[:weight]" entry: (name, target, weight)."""
    short, text = _short_name(text)
    if text.startswith(REMOTE):
        target, weight = _split_remote(text)
        return short or target, target, weight
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"reward spec entry {text.strip()!r} has more than one ':'; expected 'name' or 'name:weight'")
    name = _name(parts[0], text.strip())
    return name, name, (_weight(parts[1].strip(), text.strip()) if len(parts) == 2 else 1.0)


def _named(key: Any, where: str) -> tuple[str, str]:
    """(name, target) of a dict key or pair name, which may be "short=remote:<url>"."""
    short, entry = _short_name(_name(key, where))
    return short or entry, entry


def parse_spec_targets(spec: str | dict | list | tuple) -> list[tuple[str, str, float]]:
    """Parse a reward spec into (name, target, weight): `name` keys the metrics and reward.args, `target` is
    what `get` builds (they differ only for "short=remote:<url>"); a name without a weight gets 1.0.

    Accepts "a:1.0, b:0.1", a dict {name: weight}, or a list of (name, weight)
    pairs or "name[:weight]" strings (the forms a YAML config produces).
    """
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError("reward spec is empty; expected e.g. 'digit_alignment:1.0,jpeg_compressibility:0.1'")
        entries = []
        for i, part in enumerate(spec.split(",")):
            if not part.strip():
                raise ValueError(f"reward spec {spec!r} has an empty entry at position {i}")
            entries.append(_parse_entry(part))
    elif isinstance(spec, dict):
        entries = [(*_named(k, str(k)), _weight(v, f"{k}: {v}")) for k, v in spec.items()]
    elif isinstance(spec, (list, tuple)):
        entries = []
        for item in spec:
            if isinstance(item, str):
                entries.append(_parse_entry(item))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                entries.append((*_named(item[0], str(item)), _weight(item[1], str(item))))
            else:
                raise ValueError(f"reward spec entry {item!r} is not valid; expected 'name[:weight]' or (name, weight)")
    else:
        raise ValueError(f"reward spec must be a string, dict or list, got {type(spec).__name__}")
    if not entries:
        raise ValueError("reward spec is empty; expected at least one scorer name")
    names = [n for n, _, _ in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"reward spec names a scorer more than once: {', '.join(dupes)}")
    return entries


def parse_spec(spec: str | dict | list | tuple) -> list[tuple[str, float]]:
    """Parse a reward spec into (name, weight) pairs (see `parse_spec_targets`)."""
    return [(name, weight) for name, _, weight in parse_spec_targets(spec)]


# ---- scorer arguments from the config ---------------------------------------------------------------


def _factory_target(factory: Callable) -> Callable:
    """What a factory builds (a lazy built-in's or a plugin's class), for its signature."""
    return factory.target() if hasattr(factory, "target") else factory


def scorer_parameters(target: str) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """({argument: (parameter, type hint)}, takes any keyword) of the scorer `target` builds.

    A class's `**kwargs` that go to its base class are followed up the MRO (Aesthetic -> the CLIP base),
    so the arguments listed are the ones that are really taken. A remote scorer's address is its spec."""
    if target.startswith(REMOTE):
        from rewards.remote import RemoteScorer

        built, skip = RemoteScorer, {"url"}
    else:
        built, skip = _factory_target(factory_of(target)), set()
    functions = ([k.__dict__["__init__"] for k in built.__mro__ if k is not object and "__init__" in k.__dict__]
                 if inspect.isclass(built) else [built])
    params: dict[str, tuple[inspect.Parameter, Any]] = {}
    for function in functions:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin without a signature: anything goes
            return params, True
        try:
            hints = typing.get_type_hints(function)
        except Exception:  # annotations that do not resolve: coerce by the defaults' types
            hints = {}
        takes_more = False
        for i, (name, param) in enumerate(signature.parameters.items()):
            if inspect.isclass(built) and i == 0:
                continue  # self
            if param.kind is param.VAR_KEYWORD:
                takes_more = True
            elif param.kind is not param.VAR_POSITIONAL and name not in skip:
                params.setdefault(name, (param, hints.get(name, Any)))
        if not takes_more:
            return params, False
    return params, True


def _allowed_types(param: inspect.Parameter, hint: Any) -> set:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    kinds = {o for o in options if isinstance(o, type)}
    if not kinds and param.default not in (None, param.empty):
        kinds = {type(param.default)}
    return kinds


def _coerce(value: Any, param: inspect.Parameter, hint: Any, where: str) -> Any:
    """A command-line string as the number or boolean the scorer's argument takes (YAML gives typed values)."""
    kinds = _allowed_types(param, hint)
    if not isinstance(value, str) or not kinds or str in kinds or not kinds & {bool, int, float}:
        return value
    text = value.strip().lower()
    if bool in kinds and text in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return text in ("true", "yes", "on", "1")
    if int in kinds:
        try:
            return int(text)
        except ValueError:
            pass
    if float in kinds:
        try:
            return float(text)
        except ValueError:
            pass
    if type(None) in typing.get_args(hint) and text in ("none", "null", "~"):
        return None
    names = " or ".join(sorted(k.__name__ for k in kinds))
    raise ValueError(f"{where}={value!r}: expected {names}")


def scorer_args(reward_args: Any) -> dict[str, dict[str, Any]]:
    """The config's reward.args as {scorer name: {argument: value}}.

    Accepts {name: {arg: value}} (YAML, or `reward.args={pickscore: {path: /x}}`), the flat entries that
    dotted overrides leave (`reward.args.pickscore.path=/x` -> {"pickscore.path": "/x"}: the argument is the
    part after the last dot) and a mapping given as text (`reward.args.pickscore={path: /x}`).
    """
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for key, value in dict(reward_args or {}).items():
        key = str(key)
        if isinstance(value, str) and "." not in key:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
        if hasattr(value, "items"):
            out.setdefault(key, {}).update({str(k): v for k, v in value.items()})
            continue
        name, dot, arg = key.rpartition(".")
        if not dot or not name or not arg:
            raise ValueError(f"reward.args.{key}={value!r}: give the arguments of scorer {key!r} as a mapping, e.g. "
                             f"reward.args.{key}.path=/models/x or reward.args={{{key}: {{path: /models/x}}}}")
        out.setdefault(name, {})[arg] = value
    return out


def resolve_args(spec: str | dict | list | tuple, reward_args: Any) -> dict[str, dict[str, Any]]:
    """{name: kwargs} for `RewardSet(spec, scorer_kwargs=...)` from the config's reward.args: each scorer named
    in the spec, each argument one its factory takes (command-line text converted to its type); a ValueError
    naming the key and the valid names otherwise."""
    entries = parse_spec_targets(spec)
    args = scorer_args(reward_args)
    names = [n for n, _, _ in entries]
    stray = [n for n in args if n not in names]
    if stray:
        raise ValueError(f"reward.args.{stray[0]}: {stray[0]!r} is not a scorer of rewards ({', '.join(names)}); "
                         "reward.args are keyed by the names in the reward spec")
    resolved = {}
    for name, target, _ in entries:
        if name not in args:
            continue
        params, takes_any = scorer_parameters(target)
        unknown = sorted(a for a in args[name] if a not in params)
        if unknown and not takes_any:
            raise ValueError(f"reward.args.{name}.{unknown[0]}: scorer {target!r} takes no argument {unknown[0]!r}; "
                             f"valid arguments: {', '.join(params) or '(none)'}")
        resolved[name] = {a: (_coerce(v, *params[a], f"reward.args.{name}.{a}") if a in params else v)
                          for a, v in args[name].items()}
    return resolved


def check_spec(spec: Any, reward_args: Any = None, modules: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The problems of a config's reward keys, each one line naming its key: modules that do not import
    (imported here, so their scorers register before the spec is checked), a spec that does not parse,
    scorers that are neither registered nor installed, and reward.args that the scorers do not take."""
    try:
        import_modules(list(modules or ()))
    except ImportError as exc:
        return [str(exc)]
    try:
        entries = parse_spec_targets(spec)
    except ValueError as exc:
        return [f"reward.scorers={spec!r}: {exc}"]
    # A weight of 0 is a value the run would ignore: the scorer is built and called every step and never moves
    # the reward (every weight 0: the reward is constant and nothing trains).
    zero = [name for name, _, weight in entries if weight == 0]
    problems = []
    if zero:
        problems.append(f"reward.scorers={spec!r}: {', '.join(zero)} {'has' if len(zero) == 1 else 'have'} weight 0, "
                        f"so {'it is scored and never rewards' if len(zero) == 1 else 'they are scored and never reward'}"
                        f"{' (the reward would be constant: nothing trains)' if len(zero) == len(entries) else ''}; "
                        f"give a non-zero weight (negative penalises), or to only evaluate, list it in eval.judges")
    for _, target, _ in entries:
        if not target.startswith(REMOTE):
            try:
                factory_of(target)
            except KeyError as exc:
                problems.append(f"reward.scorers={spec!r}: {exc.args[0]}")
            except (ImportError, TypeError, ValueError) as exc:
                problems.append(f"reward.scorers={spec!r}: {exc}")
    if problems:
        return problems
    try:
        resolve_args(spec, reward_args)
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        return [str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)]
    return []


def is_differentiable_target(target: str) -> bool:
    """Whether the scorer `target` builds passes gradients to the images (its class's `differentiable`, see
    `rewards.types.Scorer`), found without building it. A remote scorer never does (its images cross HTTP)."""
    if target.startswith(REMOTE):
        return False
    return is_differentiable(_factory_target(factory_of(target)))


def differentiable_scorers() -> list[str]:
    """The names of the known scorers (registered and installed plugins) that pass gradients to the images."""
    out = []
    for name in available():
        try:
            if is_differentiable_target(name):
                out.append(name)
        except (KeyError, ImportError, TypeError, ValueError):  # a plugin that does not load: not one of them
            continue
    return out


def _lazy(module: str, attr: str) -> ScorerFactory:
    """A factory that imports `module.attr` only when called, so importing `rewards` loads no weights."""

    def factory(**kwargs: Any) -> Scorer:
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.target = lambda: getattr(importlib.import_module(module), attr)  # the class, for its signature
    factory.__qualname__ = f"lazy({module}.{attr})"
    return factory


register("digit_alignment", _lazy("rewards.digits", "DigitAlignment"))
register("number_alignment", _lazy("rewards.digits", "NumberAlignment"))
register("jpeg_compressibility", _lazy("rewards.jpeg", "JpegCompressibility"))
register("jpeg_incompressibility", _lazy("rewards.jpeg", "JpegIncompressibility"))
register("ocr", _lazy("rewards.ocr", "OcrReward"))
register("clip_score", _lazy("rewards.clip", "ClipScore"))
register("pickscore", _lazy("rewards.clip", "PickScore"))
register("aesthetic", _lazy("rewards.clip", "Aesthetic"))
register("audio_loudness", _lazy("rewards.audio", "AudioLoudness"))
register("av_onset_sync", _lazy("rewards.audio", "AvOnsetSync"))
register("vlm_judge", _lazy("rewards.vlm_judge", "VlmJudge"))
register("clip_score_video", _lazy("rewards.video", "clip_score_video"))
register("pickscore_video", _lazy("rewards.video", "pickscore_video"))
register("aesthetic_video", _lazy("rewards.video", "aesthetic_video"))
register("hpsv3", _lazy("rewards.hpsv3", "HPSv3"))
register("edit_consistency", _lazy("rewards.edit", "EditConsistency"))
register("edit_instruction_clip", _lazy("rewards.edit", "EditInstructionClip"))


# Checks of a scorer's arguments that need no weights (a local folder's files), by scorer name: run before a
# training run writes anything, so a missing folder is one line rather than a traceback after minutes of setup.
_ARG_CHECKS: dict[str, Callable[..., None]] = {}


def _declared(name: str, attribute: str):
    """What scorer `name`'s class declares as `attribute` (None when it declares nothing, or for a remote scorer,
    whose class is on the other side of the wire). KeyError for an unknown name."""
    if name.startswith(REMOTE):
        return None
    return getattr(_factory_target(factory_of(name)), attribute, None)


def prompt_coverage(name: str, prompts: list[str], metadata: list[dict]) -> tuple[list[bool], str] | None:
    """Which of these rows scorer `name` can score, and what a row needs for it, for a scorer whose class says
    (a static `scored_rows(prompts, metadata)` and a `prompt_needs` text); None for the others (remote ones
    included), which are found out only when they score. KeyError for an unknown name; ValueError from the
    scorer for a row it refuses (a metadata digit out of range)."""
    scored_rows = _declared(name, "scored_rows")
    if scored_rows is None:
        return None
    return [bool(ok) for ok in scored_rows(prompts, metadata)], _declared(name, "prompt_needs") or "a target it reads"


def output_range(name: str) -> tuple[float, float] | None:
    """The (low, high) every score of scorer `name` lies in, for a scorer whose class declares it (a static
    `output_range`: the digit, number, OCR, CLIP-cosine and VLM-judge rewards); None for the others (remote ones
    included). KeyError for an unknown name."""
    declared = _declared(name, "output_range")
    return None if declared is None else (float(declared[0]), float(declared[1]))


def total_reward_bounds(spec) -> tuple[float, float] | None:
    """(low, high) of the weighted-sum reward under `spec`: each scorer's `output_range` end that its weight's sign
    makes the lowest (highest); None when a scorer declares no range (then there is no bound). KeyError or
    ValueError as `parse_spec_targets` and `output_range`."""
    low = high = 0.0
    for _, target, weight in parse_spec_targets(spec):
        bounds = output_range(target)
        if bounds is None:
            return None
        ends = (weight * bounds[0], weight * bounds[1])
        low, high = low + min(ends), high + max(ends)
    return low, high


def total_reward_span(spec) -> float | None:
    """The widest gap two samples' weighted-sum rewards under `spec` can have (the sum over its scorers of
    |weight| x (high - low) of their `output_range`); None when a scorer declares no range."""
    bounds = total_reward_bounds(spec)
    return None if bounds is None else bounds[1] - bounds[0]


def register_check(name: str, check: Callable[..., None]) -> None:
    """Register `check(**kwargs)` for scorer `name`: it raises (ValueError, OSError) when the scorer could not be
    built with those kwargs, without building it. Scorers without a check are only checked when built."""
    if not callable(check):
        raise TypeError(f"the check for scorer {name!r} must be callable, got {type(check).__name__}")
    _ARG_CHECKS[name] = check


def check_scorer(name: str, **kwargs: Any) -> None:
    """What can be known about scorer `name` before building it: KeyError for an unknown name, ValueError for a
    malformed `remote:<url>`, and whatever the scorer's registered check raises for `kwargs` (a missing folder).
    Reaching a remote server is not checked here (see `rewards.remote.RemoteScorer`, which asks its /health)."""
    if name.startswith(REMOTE):
        from rewards.remote import check_url

        check_url(name[len(REMOTE):])
        return
    factory_of(name)  # KeyError naming the known ones; finds an installed plugin too
    check = _ARG_CHECKS.get(name)
    if check is not None:
        check(**kwargs)


def _lazy_check(module: str, attr: str) -> Callable[..., None]:
    """`module.attr.check_args(**kwargs)` (a scorer class's, or a factory's attribute), imported only when called."""
    return lambda **kwargs: getattr(importlib.import_module(module), attr).check_args(**kwargs)


for _name_, _class_ in (("clip_score", "ClipScore"), ("pickscore", "PickScore"), ("aesthetic", "Aesthetic")):
    register_check(_name_, _lazy_check("rewards.clip", _class_))
for _name_, _class_ in (("edit_consistency", "EditConsistency"), ("edit_instruction_clip", "EditInstructionClip")):
    register_check(_name_, _lazy_check("rewards.edit", _class_))
register_check("hpsv3", _lazy_check("rewards.hpsv3", "HPSv3"))
register_check("vlm_judge", _lazy_check("rewards.vlm_judge", "VlmJudge"))
for _name_ in ("clip_score_video", "pickscore_video", "aesthetic_video"):
    register_check(_name_, _lazy_check("rewards.video", _name_))
