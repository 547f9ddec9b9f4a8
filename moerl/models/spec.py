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


def replace_norms(node: Any, norm: Any = SequenceParallelTorchNorm) -> Any:
    """Return ``node`` (a spec tree) with every local norm class replaced by ``norm``."""
    if _is_megatron_norm(node):
        return norm
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(
            node,
            module=replace_norms(node.module, norm),
            submodules=replace_norms(node.submodules, norm),
        )
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: replace_norms(getattr(node, f.name), norm)
            for f in dataclasses.fields(node)
            if f.init
        }
        return dataclasses.replace(node, **changes)
    if isinstance(node, list):
        return [replace_norms(item, norm) for item in node]
    return node


def decoder_block_spec(
    config: Any,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    pp_rank: int | None = None,
) -> Any:
    """megatron-core's decoder block spec for this pipeline stage (dense and MoE layers
    placed by ``config.moe_layer_freq``), with TE modules when transformer-engine is
    installed and the local modules plus an SP-capable norm otherwise. ``pp_rank``
    defaults to this process's pipeline rank."""
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
    return spec if use_te else replace_norms(spec)
