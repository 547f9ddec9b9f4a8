"""`python -m moerl.launch --help`: every key of the composed config with its type,
value and the docstring written under its dataclass field.

Hydra prints the help template in conf/config.yaml (`hydra.help.template`); its
`${moerl_keys:}` is the resolver registered here, which walks the composed config (so
`+recipe=NAME task=arithmetic --help` lists that recipe's values and that task's keys).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

from omegaconf import DictConfig, OmegaConf

RESOLVER = "moerl_keys"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name → the string literal written under it in ``cls`` or its base classes."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a class made at run time)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for field, after in zip(body, body[1:]):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(cls: type, name: str) -> str:
    for field in dataclasses.fields(cls):
        if field.name == name:
            hint = field.type
            return hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    return "?"


def _value(node: DictConfig, key: str) -> str:
    container = OmegaConf.to_container(node, resolve=False)
    assert isinstance(container, dict)
    raw = container[key]
    return "???" if raw == "???" else OmegaConf.to_yaml({"v": raw}).strip()[len("v: ") :]


def describe(node: DictConfig, prefix: str) -> list[str]:
    """One entry per key of a structured node (nested ones recursively)."""
    cls = OmegaConf.get_type(node)
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        return []
    docs = field_docs(cls)
    lines = [f"{prefix} ({cls.__name__})"] if prefix else []
    for key in node:
        key = str(key)
        path = f"{prefix}.{key}" if prefix else key
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            lines += describe(child, path)
            continue
        lines.append(f"  {path}: {_type_name(cls, key)} = {_value(node, key)}")
        if docs.get(key):
            lines += textwrap.wrap(docs[key], 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def keys_help(*, _root_: DictConfig) -> str:
    """The `== Keys ==` section: every group of the composed config, `hydra` left out.
    A `$` is doubled for the template Hydra substitutes into."""
    lines = []
    for group in _root_:
        if group != "hydra" and isinstance(_root_._get_node(str(group)), DictConfig):
            lines += describe(_root_[group], str(group))
    return "\n".join(lines).replace("$", "$$")


def register_help_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, keys_help)
