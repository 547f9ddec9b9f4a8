"""Layer specs: megatron-core's own local (non-TE) specs, or TE specs when installed.

Without transformer-engine, megatron-core's local spec uses ``WrappedTorchNorm``,
which refuses sequence parallelism (required for MoE with TP > 1). We swap every
norm slot of the local spec for ``SequenceParallelTorchNorm``; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from moerl.compat.norm import SequenceParallelTorchNorm


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _is_megatron_norm(obj: Any) -> bool:
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return obj is WrappedTorchNorm or obj is FusedLayerNorm


def map_spec(node: Any, fn: Any) -> Any:
    """Rebuild a spec tree bottom-up, letting ``fn`` replace any node (class or spec)."""
    if isinstance(node, ModuleSpec):
        node = dataclasses.replace(
            node, module=map_spec(node.module, fn), submodules=map_spec(node.submodules, fn)
        )
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: map_spec(getattr(node, f.name), fn) for f in dataclasses.fields(node) if f.init
        }
        node = dataclasses.replace(node, **changes)
    elif isinstance(node, list):
        return [map_spec(item, fn) for item in node]
    return fn(node)


def replace_norms(node: Any, norm: Any = SequenceParallelTorchNorm) -> Any:
    """Return ``node`` (a spec tree) with every local norm class replaced by ``norm``."""
    return map_spec(node, lambda n: norm if _is_megatron_norm(n) else n)


def use_local_attention(node: Any) -> Any:
    """Give every ``SelfAttention`` and ``MLASelfAttention`` in a local spec tree
    ``LocalCoreAttention`` (fused SDPA instead of megatron-core's unfused
    ``DotProductAttention``)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from moerl.models.local_attention import LocalCoreAttention

    def swap(n: Any) -> Any:
        if isinstance(n, ModuleSpec) and n.module in (SelfAttention, MLASelfAttention):
            sub = dataclasses.replace(n.submodules, core_attention=LocalCoreAttention)
            return dataclasses.replace(n, submodules=sub)
        return n

    return map_spec(node, swap)


def decoder_block_spec(
    config: Any,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    pp_rank: int | None = None,
    grouped_experts: bool = False,
) -> Any:
    """megatron-core's decoder block spec for this pipeline stage (dense and MoE layers
    placed by ``config.moe_layer_freq``), with TE modules when transformer-engine is
    installed and the local modules plus an SP-capable norm otherwise. ``pp_rank``
    defaults to this process's pipeline rank; ``grouped_experts``: the local spec's
    routed experts are ``GroupedSequentialMLP`` (``moerl.models.grouped_experts``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if use_te is None:
        use_te = have_transformer_engine()
    spec = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_te,
        normalization=config.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    if use_te:
        return spec
    spec = replace_norms(spec)
    if grouped_experts:
        spec = use_grouped_experts(spec)
    return use_local_attention(spec)


def use_grouped_experts(node: Any) -> Any:
    """Give every ``SequentialMLP`` of a local spec tree the grouped-GEMM forward."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moerl.models.grouped_experts import GroupedSequentialMLP

    return map_spec(node, lambda n: GroupedSequentialMLP if n is SequentialMLP else n)
