"""Full tensors ⇄ sharded layouts through megatron-core's sharded state dict."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moerl.parallel import spawn
from moerl.checks.parity import tiny_moe


def _roundtrip(layout: str) -> None:
    from moerl.models.gpt import build_model
    from moerl.parallel import initialize_model_parallel, parse_layout
    from moerl.parallel.full_state import gather_full, load_full

    model = tiny_moe()
    pcfg, _ = parse_layout(layout)
    initialize_model_parallel(
        pcfg,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        num_experts=model.num_experts,
        seed=3,
    )
    chunks = build_model(model, pcfg)
    first = gather_full(chunks, "param")
    # A full state made on rank 0 (random, layout-free) is broadcast, loaded, gathered back.
    full = None
    if dist.get_rank() == 0:
        assert first is not None and not first.uncovered
        gen = torch.Generator().manual_seed(11)
        full = {k: torch.randn(v.shape, generator=gen) for k, v in first.tensors.items()}
    holder = [full]
    dist.broadcast_object_list(holder, src=0)
    full = holder[0]
    load_full(chunks, full)
    back = gather_full(chunks, "param")
    if dist.get_rank() == 0:
        assert back is not None and not back.uncovered
        assert back.replica_max_abs_diff == 0.0
        assert set(back.tensors) == set(full)
        for key, tensor in full.items():
            assert torch.equal(back.tensors[key], tensor), key
        # experts are stacked along a prepended axis: [num_experts, out, in]
        fc1 = back.tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
        assert fc1.shape == (4, 2 * model.moe_ffn_hidden_size, model.hidden_size)
    bad = dict(full)
    key = "output_layer.weight"
    bad[key] = bad[key][:, :-1]
    with pytest.raises(ValueError, match=key):
        load_full(chunks, bad)
    del bad[key]
    with pytest.raises(KeyError, match="lacks"):
        load_full(chunks, bad)


@pytest.mark.parametrize("layout", ["tp2ep2"])
def test_load_and_gather_roundtrip(layout):
    from moerl.parallel import parse_layout

    spawn(_roundtrip, parse_layout(layout)[1], layout)
