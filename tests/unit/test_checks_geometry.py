"""Router geometries: the real router's shape, routers scaled to the stated logit spread,
margins measured at the top-k boundary."""

from __future__ import annotations

import pytest
import torch

from moerl.checks.geometry import (
    _gate_inputs,
    _gates,
    geometry_config,
    margins,
    scale_routers,
)
from moerl.models.hf_tiny import build_hf_model


def test_geometries_keep_the_real_routers():
    q, d = geometry_config("qwen3_30b_router"), geometry_config("deepseek_v3_router")
    assert (q.num_experts, q.moe_router_topk, q.moe_router_score_function) == (128, 8, "softmax")
    assert (d.num_experts, d.moe_router_topk, d.moe_router_score_function) == (256, 8, "sigmoid")
    assert (d.moe_router_num_groups, d.moe_router_group_topk) == (8, 4)
    assert d.moe_router_enable_expert_bias
    with pytest.raises(ValueError, match="choose one of"):
        geometry_config("mixtral")


@pytest.mark.slow  # ~30 s on 2 cores; keeps the default suite under its 20 minutes
def test_scaled_routers_reach_the_stated_spread_and_margins_grow():
    model = geometry_config("qwen3_30b_router")
    hf_model = build_hf_model(model, seed=0)
    before = margins(hf_model, model)["all"]["p50"]
    factors = scale_routers(hf_model, model, router_std=1.5)
    assert len(factors) == model.num_layers and all(f > 1 for f in factors)
    tokens = torch.randint(4, 100, (16, 32), generator=torch.Generator().manual_seed(0))
    for gate, x_TH in zip(_gates(hf_model), _gate_inputs(hf_model, tokens)):
        with torch.no_grad():
            std = (x_TH @ gate.weight.T).std(dim=-1).mean()
        assert std == pytest.approx(1.5, rel=1e-3)
    after = margins(hf_model, model)
    assert after["score"] == "logit" and len(after["per_layer"]) == model.num_layers
    assert after["all"]["p50"] > 5 * before  # from near-uniform scores to trained-like gaps
