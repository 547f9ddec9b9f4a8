"""Model families by name: one `ModelFamily` spec per family, one registry.

A family (``moerl/models/<family>/``) bundles what moerl needs to read and write a
Hugging Face architecture: its config.json ⇄ ``ModelConfig`` translation, its HF ⇄
Megatron tensor map, the ``model_type`` strings it reads and the transformers class that
builds a random model of it. Consumers look it up here, by name (``model.family``) or by
a checkpoint's ``model_type``; none keeps its own list.

A family outside moerl plugs in without editing moerl, either way:

    model.family=mylab.families.TOY_MOE    the import path of a ModelFamily: imported
                                           wherever it is looked up (spawned ranks too)
                                           and registered under that path
    register_family(TOY_MOE)               in a module you import; then model.family=toy_moe
                                           in every process that imported it

'gpt' (plain megatron-core layers, no Hugging Face format) is not a family here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moerl.common.registry import Catalog
from moerl.config.model import ModelConfig

if TYPE_CHECKING:
    from moerl.models.maps import FamilyMap

BUILTIN = ("moerl.models.qwen3_moe", "moerl.models.deepseek_moe")
"""Packages of the shipped families; each registers its spec when imported."""
PLAIN = "gpt"
"""model.family of plain megatron-core layers (no Hugging Face format, no family spec)."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything moerl knows about one Hugging Face architecture."""

    name: str
    """The model.family value it is selected by (its registry key)."""
    hf_model_types: tuple[str, ...]
    """config.json ``model_type`` values it reads; the first is the one `to_hf` writes."""
    hf_architecture: str
    """The transformers model class that builds a random model of it: a name in
    ``transformers`` (``Qwen3MoeForCausalLM``) or an import path (``mylab.modeling.Toy``).
    Its ``model_type`` must be known to ``transformers.AutoConfig``."""
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    """config.json (as a dict) → the architecture; `from_hf` checks the model type and
    sets ``family`` around it."""
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    """The architecture → config.json fields; `to_hf` adds ``model_type``."""
    weight_map: Callable[[ModelConfig], FamilyMap]
    """HF ⇄ Megatron tensor names and converters for a model of this shape."""
    tiny: Callable[[], ModelConfig] | None = None
    """A CPU-fast config exercising every feature of the family (tests and tools)."""

    def __post_init__(self) -> None:
        if not self.hf_model_types:
            raise ValueError(f"model family {self.name!r} needs at least one hf_model_types")

    def from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        """The ``ModelConfig`` of an HF config.json; ValueError for another family's."""
        got = cfg.get("model_type")
        if got not in self.hf_model_types:
            raise ValueError(
                f"checkpoint config.json has model_type={got!r}, which is not the "
                f"{self.name!r} family (expects {' or '.join(self.hf_model_types)}); choose the "
                "family that matches the checkpoint"
            )
        return dataclasses.replace(self.config_from_hf(cfg), family=self.name)

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        """The HF config.json fields of ``model``, ``model_type`` first."""
        return {"model_type": self.hf_model_types[0], **self.config_to_hf(model)}

    def tiny_config(self) -> ModelConfig:
        if self.tiny is None:
            raise ValueError(f"model family {self.name!r} has no tiny config")
        return dataclasses.replace(self.tiny(), family=self.name)

    def hf_model_class(self) -> type:
        import transformers

        found = getattr(transformers, self.hf_architecture, None)
        if found is None:
            from hydra.utils import get_class

            found = get_class(self.hf_architecture)
        return found


FAMILIES: Catalog[ModelFamily] = Catalog(
    "model family",
    "model.family",
    f"'{PLAIN}' is plain megatron-core layers. For a family outside moerl set model.family "
    "to the import path of its ModelFamily (model.family=mylab.families.MY_MOE) or call "
    "moerl.models.register_family(spec) in a module you import",
)
_loaded = False


def register_family(spec: ModelFamily) -> ModelFamily:
    """Add ``spec`` under ``spec.name``; returns it (so a module can write
    ``TOY = register_family(ModelFamily(...))``)."""
    if not isinstance(spec, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, not {type(spec).__name__}")
    FAMILIES.add(spec.name, spec)
    return spec


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def _import(path: str) -> ModelFamily:
    """The ModelFamily at import path ``path``, registered under ``path``."""
    from hydra.utils import get_object

    from moerl.common.imports import quiet_hydra_utils

    try:
        with quiet_hydra_utils():
            found = get_object(path)
    except Exception as err:  # hydra wraps import errors in its own types
        reason = " ".join(str(err).split())
        raise ValueError(
            f"model.family={path!r} is not a registered family and could not be imported as "
            f"a ModelFamily: {reason}. Known families: {', '.join(FAMILIES.names())}"
        ) from err
    if not isinstance(found, ModelFamily):
        raise ValueError(
            f"model.family={path!r} imports a {type(found).__name__}, not a "
            "moerl.models.ModelFamily"
        )
    if path not in FAMILIES:  # importing it may have registered it under this path
        FAMILIES.add(path, dataclasses.replace(found, name=path))
    return FAMILIES.get(path)


def get_family(name: str) -> ModelFamily:
    """The family selected by ``name``: a registered name or the import path of a
    ModelFamily. ValueError naming the known families otherwise."""
    _load_builtins()
    if name in FAMILIES:
        return FAMILIES.get(name)
    if "." in name:
        return _import(name)
    raise ValueError(
        f"model.family={name!r} is not a registered model family; known: "
        f"{', '.join(FAMILIES.names())}. {FAMILIES.hint}"
    )


def family_names() -> list[str]:
    """Names of the registered families (the shipped ones and any registered since)."""
    _load_builtins()
    return FAMILIES.names()


def tiny_families() -> list[str]:
    """Names of the registered families that have a tiny config."""
    _load_builtins()
    return sorted(f.name for f in FAMILIES.values() if f.tiny is not None)


def family_for_model_type(model_type: str | None) -> ModelFamily:
    """The registered family that reads config.json ``model_type``; ValueError if none
    or several (distinct) families do."""
    _load_builtins()
    found: list[ModelFamily] = []
    for family in FAMILIES.values():
        same = any(_same_spec(family, f) for f in found)
        if model_type in family.hf_model_types and not same:
            found.append(family)
    if not found:
        known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
        raise ValueError(
            f"config.json model_type={model_type!r} is not read by any registered model family "
            f"(known model types: {', '.join(known)}); pass the family explicitly"
        )
    if len(found) > 1:
        raise ValueError(
            f"config.json model_type={model_type!r} is read by several model families "
            f"({', '.join(f.name for f in found)}); pass the family explicitly"
        )
    return found[0]


def _same_spec(a: ModelFamily, b: ModelFamily) -> bool:
    """One spec registered under two names (a short name and its import path)."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")
