"""Pieces the Llama-style HF families share: rope fields and tensor-map entries."""

from __future__ import annotations

from typing import Any

from moerl.config.model import ModelConfig
from moerl.models.maps import Concat, Copy, Entry

GLOBALS = [
    Entry(("embedding.word_embeddings.weight",), Copy("model.embed_tokens.weight")),
    Entry(("decoder.final_layernorm.weight",), Copy("model.norm.weight")),
]
OUTPUT = Entry(("output_layer.weight",), Copy("lm_head.weight"))

# megatron-core names a layer's norms after the linear they precede when the local
# spec is used for GQA; MLA layers keep the module names. Both spellings map.
INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
PRE_MLP_NORM = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, yarn-style scaling or None) from transformers 4.x or 5.x fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = (scaling or params).get("rope_type", (scaling or params).get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    merged = {k: v for k, v in (scaling or params).items() if k not in ("rope_theta",)}
    merged["type"] = kind
    return float(theta), merged


def mlp_entries(prefix: str, megatron: str) -> list[Entry]:
    """A gated MLP: HF gate/up/down under ``prefix``, megatron fc1/fc2 under ``megatron``."""
    return [
        Entry(
            (f"{megatron}.linear_fc1.weight",),
            Concat((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")),
        ),
        Entry((f"{megatron}.linear_fc2.weight",), Copy(f"{prefix}.down_proj.weight")),
    ]


def expert_entries() -> list[Entry]:
    """Routed experts: one HF MLP per expert ⇄ megatron's expert-stacked fc1/fc2."""
    prefix = "mlp.experts.{expert}"
    return [
        Entry(
            ("mlp.experts.experts.linear_fc1.weight",),
            Concat((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")),
            expert=True,
        ),
        Entry(
            ("mlp.experts.experts.linear_fc2.weight",),
            Copy(f"{prefix}.down_proj.weight"),
            expert=True,
        ),
    ]


def global_entries(m: ModelConfig) -> list[Entry]:
    """Embedding, final norm and (unless tied) the output layer."""
    return GLOBALS + ([] if m.tie_word_embeddings else [OUTPUT])
