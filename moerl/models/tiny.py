"""Tiny configs of each family (its ``ModelFamily.tiny``; the shipped families read
``conf/model/<family>_tiny.yaml``, the one source of their numbers): a few hundred
thousand parameters, CPU-fast, and shaped so every feature of the family is exercised
(dense + MoE layers, GQA with q/k norm or MLA with a q down-projection, shared experts,
group-limited sigmoid routing with an expert bias)."""

from __future__ import annotations

from importlib import resources

from omegaconf import DictConfig, OmegaConf

from moerl.config.model import ModelConfig


def model_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of ``conf/model/NAME.yaml``."""
    path = resources.files("moerl.conf") / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no model config conf/model/{name}.yaml")
    raw = OmegaConf.load(str(path))
    if not isinstance(raw, DictConfig):
        raise ValueError(f"conf/model/{name}.yaml is not a mapping")
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def tiny_config(family: str) -> ModelConfig:
    """The tiny config of a registered family (or the import path of one)."""
    from moerl.models.registry import get_family, tiny_families

    spec = get_family(family)
    if spec.tiny is None:
        raise ValueError(f"no tiny config for family {family!r}; choose one of {tiny_families()}")
    return spec.tiny_config()
