"""Recipes as options of the group `recipe`, and the rule that makes them honest: a group
option chosen on the command line always wins over a recipe.

A recipe (recipes/NAME.yaml) selects options in its defaults list (`override /task:
arithmetic`) and sets keys (`task: {max_operand: 9}`). Hydra merges a recipe's keys after
every group's option, so a key of a group the user picks on the command line would land on
the user's option: `+recipe=deepseek_moe staleness=sync` ran depth with max_staleness 1.

So the keys of a group a recipe selects travel with its choice: `split_recipe` stores them
as a derived option of that group, `OPTION_for_RECIPE` (the option plus the keys), which
the recipe selects instead. `task=copy_digits` on the command line replaces that option,
keys and all. Keys of a group the recipe does not select (`trainer`, `rollout`: one option
each) stay in the recipe; `check_recipe_choices` refuses a command line that chooses such
a group, naming the keys the recipe would write over the user's option.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

RECIPE_PACKAGE = "moerl.recipes"
RECIPE_GROUP = "recipe"
_OVERRIDE = "override "


@dataclass
class Recipe:
    """A recipe split into what Hydra stores: the recipe itself and its derived options."""

    name: str
    """The option name in the group `recipe` (the file name without `.yaml`)."""
    node: DictConfig
    """The recipe, its defaults list selecting the derived options, its other keys kept."""
    options: dict[str, tuple[str, DictConfig]] = field(default_factory=dict)
    """group → (derived option name, its node: defaults [the recipe's option] + the keys)."""


def package_header(text: str) -> str | None:
    """The `# @package X` value from the comment lines that open a YAML file."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.startswith("#"):
            return None
        body = line.lstrip("#").strip()
        if body.startswith("@package"):
            return body[len("@package") :].strip()
    return None


def recipe_names() -> list[str]:
    """The shipped recipes, sorted."""
    files = resources.files(RECIPE_PACKAGE).iterdir()
    return sorted(e.name[: -len(".yaml")] for e in files if e.name.endswith(".yaml"))


def load_recipe(name: str) -> Recipe:
    """The shipped recipe `name`, split; ValueError for a file without the global package."""
    text = resources.files(RECIPE_PACKAGE).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    package = package_header(text)
    if package != "_global_":
        raise ValueError(
            f"recipes/{name}.yaml must start with the line '# @package _global_' (found "
            f"package {package!r}); a recipe is a change to the whole config"
        )
    node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    assert isinstance(node, DictConfig)
    return split_recipe(name, node)


def split_recipe(name: str, node: DictConfig) -> Recipe:
    """Move the keys of every group the recipe selects into a derived option of that group
    (nested groups such as `algo/loss` first, so their keys leave `algo`'s)."""
    node = node.copy()
    recipe = Recipe(name, node)
    defaults = node.get("defaults") or []
    selected = [(i, _selected_group(entry)) for i, entry in enumerate(defaults)]
    by_depth = sorted(((i, g) for i, g in selected if g), key=lambda x: -x[1][1].count("/"))
    for i, (entry_key, group) in by_depth:
        path = group.replace("/", ".")
        keys = OmegaConf.select(node, path)
        if not isinstance(keys, DictConfig) or not keys:
            continue
        option = defaults[i][entry_key]
        derived = f"{option}_for_{name}"
        own = OmegaConf.merge({"defaults": [option, "_self_"]}, keys)
        assert isinstance(own, DictConfig)
        recipe.options[group] = (derived, own)
        defaults[i] = {entry_key: derived}
        _delete(node, path)
    return recipe


def _selected_group(entry: Any) -> tuple[str, str] | None:
    """(its key, `task`) for the defaults entry `override /task: OPTION`, else None."""
    if not isinstance(entry, DictConfig) or len(entry) != 1:
        return None
    key = str(next(iter(entry.keys())))
    group = key[len(_OVERRIDE) :].strip().lstrip("/")
    if not key.startswith(_OVERRIDE) or not isinstance(entry[key], str) or not group:
        return None
    return key, group


def _delete(node: DictConfig, path: str) -> None:
    """Remove `path` from `node`, and each parent it leaves empty."""
    parts = path.split(".")
    while parts:
        parent = OmegaConf.select(node, ".".join(parts[:-1])) if len(parts) > 1 else node
        assert isinstance(parent, DictConfig)
        del parent[parts[-1]]
        parts = parts[:-1]
        if parts and OmegaConf.select(node, ".".join(parts)):
            return


# --- the command line against a recipe --------------------------------------------


def check_recipe_choices(overrides: Sequence[str], groups: Sequence[str]) -> None:
    """Refuse a command line that chooses an option of a group (`trainer=default`) whose
    keys the recipe it names sets outside that group's option: they would overwrite the
    option's values. `groups` are the config groups; a key the user also sets on the
    command line is the user's. ValueError naming the choice, the keys and the fix."""
    choices, keys = _command_line(overrides, groups)
    name = choices.pop(RECIPE_GROUP, None)
    if name is None or name not in recipe_names():
        return
    recipe = load_recipe(name)
    for group, option in choices.items():
        path = group.replace("/", ".")
        written = [
            (key, value)
            for key, value, source in _recipe_keys(recipe)
            if (key == path or key.startswith(path + "."))
            and _overwrites(source, group, choices)
            and not any(key == k or key.startswith(k + ".") for k in keys)
        ]
        if written:
            shown = " ".join(f"{k}={_shown(v)}" for k, v in written)
            raise ValueError(
                f"{group}={option} on the command line, but +recipe={name} sets {shown}, "
                f"which would overwrite that option's values; set the keys you want on the "
                "command line (copied as shown they keep the recipe's values), or leave out "
                f"{group}={option}"
            )


def _overwrites(source: str | None, group: str, choices: dict[str, str]) -> bool:
    """Whether a recipe key kept in the recipe (`source` None) or travelling with the
    recipe's choice of group `source` lands on the user's choice of `group`."""
    if source is None:
        return True
    # The user's choice of `group` replaces a derived option of `group` or of a group
    # nested in it; one of an enclosing group still merges on top, unless chosen too.
    return group.startswith(source + "/") and source not in choices


def _recipe_keys(recipe: Recipe) -> Iterator[tuple[str, Any, str | None]]:
    """(dotted key, value, the group it travels with or None) for every leaf the recipe sets."""
    body = {k: v for k, v in recipe.node.items() if k != "defaults"}
    for key, value in _leaves(OmegaConf.create(body), ""):
        yield key, value, None
    for group, (_, node) in recipe.options.items():
        own = {k: v for k, v in node.items() if k != "defaults"}
        for key, value in _leaves(OmegaConf.create(own), group.replace("/", ".") + "."):
            yield key, value, group


def _leaves(node: DictConfig, prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in node.items_ex(resolve=False):
        if isinstance(value, DictConfig) and value:
            yield from _leaves(value, f"{prefix}{key!s}.")
        else:
            yield f"{prefix}{key!s}", value


def _command_line(
    overrides: Sequence[str], groups: Sequence[str]
) -> tuple[dict[str, str], set[str]]:
    """The group choices (group → option) and the keys a command line sets."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: dict[str, str] = {}
    keys: set[str] = set()
    known = {*groups, RECIPE_GROUP}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_delete() or key.startswith("hydra"):
            continue
        if key in known and override.package is None:
            choices[key] = str(override.value())
        else:
            keys.add(key)
    return choices, keys


def _shown(value: Any) -> str:
    """A value as a command line writes it."""
    if isinstance(value, ListConfig):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)
