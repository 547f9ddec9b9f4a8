"""Name → function registries for the swappable pieces of the objective
(docs/architecture.md, "Extension points").

A built-in is a function `fn(inp, cfg) -> out` registered with its options dataclass:

    @CORRECTIONS.register("tis", TISConfig)
    def tis(inp: CorrectionInput, cfg: TISConfig) -> CorrectionOutput: ...

`Registry.build(spec)` turns a spec into a ready callable `inp -> out`. A spec is

    "tis"                                  a name: the built-in with default options
    TISConfig(cap=3.0)                     an options dataclass (what Hydra composes)
    {"name": "tis", "cap": 3.0}            a mapping / DictConfig naming a built-in
    {"_target_": "mylab.corr.my_is", ...}  the escape hatch: any importable function
                                           `fn(inp, **options)`; the other keys (or the
                                           `options` mapping) become keyword arguments

so user code outside moerl plugs in without registering anything.

`Catalog` is the name → value table underneath: `Registry` keeps its built-ins in one,
and slots whose entries are not functions (model families, `moerl.models.registry`) use
it directly, with the same wording for an unknown name.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")
V = TypeVar("V")
F = TypeVar("F", bound=Callable[..., Any])

# Keys of a mapping spec that are not keyword arguments of a `_target_` function: the
# selectors, and what a custom option declares to the trainer about its function
# (CustomCorrectionConfig.reweights, CustomPolicyLossConfig.ratio_loss).
_RESERVED = ("_target_", "name", "options", "reweights", "ratio_loss")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered built-in."""

    name: str
    """The name it is selected by."""
    fn: Callable[..., Any]
    """`fn(inp, cfg) -> out`."""
    config: type
    """Its options dataclass; `config()` gives the defaults."""


class Catalog(Generic[V]):
    """Values of one slot (`kind`) by name, selected under the config key `key`; `hint`
    ends the unknown-name error (how to use something that is not registered)."""

    def __init__(self, kind: str, key: str, hint: str) -> None:
        self.kind = kind
        self.key = key
        self.hint = hint
        self._values: dict[str, V] = {}

    def add(self, name: str, value: V) -> None:
        if name in self._values:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._values[name] = value

    def names(self) -> list[str]:
        return sorted(self._values)

    def values(self) -> list[V]:
        """In registration order."""
        return list(self._values.values())

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def get(self, name: str) -> V:
        """The value of `name`; ValueError listing the known names and the hint if unknown."""
        if name not in self._values:
            raise ValueError(
                f"{self.key}: unknown {self.kind} {name!r}; known: {', '.join(self.names())}. "
                + self.hint
            )
        return self._values[name]


class Registry(Generic[In, Out]):
    """Built-ins of one slot (`kind`), configured under the config key `key`; a `_target_`'s
    options are set under `options_key` (default `KEY.options`)."""

    def __init__(self, kind: str, key: str, options_key: str | None = None) -> None:
        self.kind = kind
        self.key = key
        self.options_key = options_key or f"{key}.options"
        self._entries: Catalog[Entry] = Catalog(
            kind, key, f"For a function outside moerl set {key}._target_ to its import path"
        )

    def register(self, name: str, config: type) -> Callable[[F], F]:
        """Decorator: register `fn(inp, cfg)` under `name` with options dataclass `config`."""
        if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
            raise TypeError(f"{self.kind} {name!r}: config must be a dataclass type")

        def deco(fn: F) -> F:
            self._entries.add(name, Entry(name, fn, config))
            return fn

        return deco

    def names(self) -> list[str]:
        return self._entries.names()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        return self._entries.get(name)

    def get(self, name: str) -> Callable[..., Any]:
        """The registered function `fn(inp, cfg)`; ValueError listing the names if unknown."""
        return self.entry(name).fn

    def config_type(self, name: str) -> type:
        """The options dataclass registered with `name`."""
        return self.entry(name).config

    def build(self, spec: Any) -> Callable[[In], Out]:
        """A callable `inp -> out` for a name, options dataclass, mapping or `_target_`."""
        if isinstance(spec, str):
            entry = self.entry(spec)
            return self._bind(entry, entry.config())
        spec = _plain(spec)
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            target = getattr(spec, "_target_", None)
            if target is not None:
                options = dict(getattr(spec, "options", None) or {})
                return self._target(
                    target, options, {k: f"{self.options_key}.{k}" for k in options}
                )
            return self._from_dataclass(spec)
        if isinstance(spec, Mapping):
            return self._from_mapping(dict(spec))
        raise TypeError(
            f"{self.key}: cannot build a {self.kind} from {type(spec).__name__}; give a name, "
            "an options dataclass or a mapping with 'name' or '_target_'"
        )

    def _bind(self, entry: Entry, cfg: Any) -> Callable[[In], Out]:
        validate = getattr(cfg, "validate", None)
        if validate is not None:
            validate(self.key)
        return functools.partial(entry.fn, cfg=cfg)

    def _from_dataclass(self, cfg: Any) -> Callable[[In], Out]:
        name = getattr(cfg, "name", None)
        if not isinstance(name, str):
            raise ValueError(f"{self.key}: {type(cfg).__name__} has no 'name' field")
        entry = self.entry(name)
        if isinstance(cfg, entry.config):
            return self._bind(entry, cfg)
        if issubclass(entry.config, type(cfg)):
            # A bare slot base (e.g. AdvantageConfig(name="rloo")) means the named built-in
            # with default options; carry over the fields the base has.
            carried = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
            return self._bind(entry, entry.config(**carried))
        raise ValueError(
            f"{self.key}.name={name!r} but its options are a {type(cfg).__name__}, not a "
            f"{entry.config.__name__}; select the option itself ({self.key}={name}) instead "
            "of renaming another one"
        )

    def _from_mapping(self, spec: dict[str, Any]) -> Callable[[In], Out]:
        if spec.get("_target_"):
            options = {k: v for k, v in spec.items() if k not in _RESERVED}
            keys = {k: f"{self.key}.{k}" for k in options}
            nested = dict(spec.get("options") or {})
            options.update(nested)
            keys.update({k: f"{self.options_key}.{k}" for k in nested})
            return self._target(spec["_target_"], options, keys)
        if "name" not in spec:
            raise ValueError(
                f"{self.key} needs 'name' (one of {', '.join(self.names())}) or '_target_'"
            )
        entry = self.entry(spec["name"])
        known = {f.name for f in dataclasses.fields(entry.config)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"{self.key}.{unknown[0]} is not an option of {self.kind} {spec['name']!r}; "
                f"its options are {', '.join(sorted(known - {'name'})) or 'none'}"
            )
        return self._bind(entry, entry.config(**spec))

    def _target(
        self, target: str, options: dict[str, Any], keys: dict[str, str]
    ) -> Callable[[In], Out]:
        """`target` imported and bound to `options`, which must fit its signature; `keys`
        names each option's config key for the error."""
        from hydra.utils import get_method

        from moerl.common.imports import quiet_hydra_utils

        if not target:
            raise ValueError(
                f"{self.key}._target_ is empty; set it to the import path of your "
                f"{self.kind} function, e.g. {self.key}._target_=mylab.module.function"
            )
        try:
            with quiet_hydra_utils():
                fn = get_method(target)
        except Exception as err:  # hydra wraps import errors in its own types
            reason = " ".join(str(err).split())  # hydra's message spans several lines
            raise ValueError(
                f"{self.key}._target_={target!r} could not be imported as a function: {reason}"
            ) from err
        check_options(fn, target, options, keys, self.key)
        return functools.partial(fn, **options) if options else fn


def check_options(
    fn: Callable[..., Any], target: str, options: dict[str, Any], keys: dict[str, str], where: str
) -> None:
    """Refuse options that `fn(inp, **options)` would reject only when first called, deep
    inside a run: a name it has no parameter for (unless it takes **kwargs), or a parameter
    after `inp` without a default that no option sets. ValueError naming the config key
    (`keys` per option, `where` the slot), the target, its parameters and, for a typo, the
    closest one."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    skip = 1 if params and params[0].kind is not inspect.Parameter.KEYWORD_ONLY else 0
    takes = [p for p in params[skip:] if p.kind in named]  # after the input `inp`
    names = [p.name for p in takes]
    shown = ", ".join(names) or "no options"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(
                    f"{keys[name]} is not a parameter of {where}._target_={target}, which "
                    f"takes {shown}{hint}"
                )
    for p in takes:
        if p.default is inspect.Parameter.empty and p.name not in options:
            raise ValueError(
                f"{where}._target_={target} needs the option {p.name!r}, which has no "
                f"default; set it among {where}'s options (it takes {shown})"
            )


def _plain(spec: Any) -> Any:
    """A DictConfig becomes its dataclass (structured) or a plain dict; others pass through."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, DictConfig):
        return OmegaConf.to_object(spec)
    return spec
