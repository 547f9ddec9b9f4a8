"""A torch LayerNorm/RMSNorm that accepts sequence parallelism.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel`` because it
does not mark its parameters; with sequence parallelism each TP rank normalizes
a different slice of the sequence, so the norm weight's gradient is partial and
must be all-reduced over TP. megatron-core's ``finalize_model_grads`` does that
for every parameter carrying ``sequence_parallel=True``, which is all this
class adds. It is the norm moerl's local (non-TE) layer specs use on CPU, where
neither apex nor transformer-engine exists, and on GPU without them.
"""

from __future__ import annotations

import torch


class SequenceParallelTorchNorm:
    """Build ``torch.nn.LayerNorm``/``RMSNorm`` with megatron-core's norm signature."""

    def __new__(  # type: ignore[misc]
        cls,
        config,  # megatron.core.transformer.TransformerConfig
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs transformer-engine or apex")
        kind = config.normalization
        if kind == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={kind!r}: choose 'LayerNorm' or 'RMSNorm'")
        norm.to(dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
