"""Small models at a real router geometry, for the mismatch study (issue #20).

The tiny family configs route among 8 experts, where a top-k decision rarely sits near a
tie; real routers choose 8 of 128 (Qwen3-30B-A3B) or 8 of 256 in groups (DeepSeek-V3).
A geometry keeps the router of the real model (experts, top-k, score function, groups,
expert bias) and shrinks everything else (hidden 64, a few layers, 16-wide experts,
vocab 128) so it runs on a CPU.

Router scale. A randomly initialised gate (std 0.02) gives router logits whose spread
over the experts is ~0.15: near-uniform scores, margins far smaller than a trained
router's, so numerics alone would flip many decisions. `scale_routers` rescales each MoE
layer's gate, in layer order (a scaled layer changes the hidden states of the next),
until the std of the router logits over experts, averaged over tokens, is
``router_std`` (default 1.5). That is our stated assumption about a trained router,
not a measurement of one (no trained router's weights are read here): Gaussian logits
over 128 experts with std 1.5 put ~0.1 of the softmax probability on the top expert and
leave a median logit gap of ~0.07 between the 8th and 9th, which we take to be a trained
fine-grained router's order of magnitude; ``--router-std`` in the bench changes it. `margins` then reports what the bench prints: per MoE layer,
the gap between the k-th and (k+1)-th selection score (softmax: router logit, the
order softmax keeps; sigmoid: sigmoid(logit) + expert bias, what DeepSeek-V3 ranks by,
before group limiting) as percentiles over tokens.

Legend: T tokens, E experts, H hidden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moerl.config.model import ModelConfig

PERCENTILES = (10, 50, 90)


def _qwen3_30b_router() -> ModelConfig:
    from moerl.models.tiny import tiny_config

    return dataclasses.replace(
        tiny_config("qwen3_moe"),
        num_layers=3, first_k_dense_replace=0,  # Qwen3-30B-A3B: every layer MoE
        num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=16,
    )  # fmt: skip


def _deepseek_v3_router() -> ModelConfig:
    from moerl.models.tiny import tiny_config

    return dataclasses.replace(
        tiny_config("deepseek_moe"),
        num_layers=4, first_k_dense_replace=1,
        num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        moe_router_num_groups=8, moe_router_group_topk=4,  # DeepSeek-V3: n_group 8, topk_group 4
        moe_router_topk_scaling_factor=2.5,
    )  # fmt: skip


GEOMETRIES: dict[str, Callable[[], ModelConfig]] = {
    "qwen3_30b_router": _qwen3_30b_router,
    "deepseek_v3_router": _deepseek_v3_router,
}
"""Geometry name → its small ModelConfig (the real router, everything else tiny)."""


def geometry_config(name: str) -> ModelConfig:
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose one of {sorted(GEOMETRIES)}")
    return GEOMETRIES[name]()


def _gates(hf_model: Any) -> list[Any]:
    """The router modules of the MoE layers, in layer order."""
    return [
        layer.mlp.gate for layer in hf_model.model.layers if hasattr(layer.mlp, "gate")
    ]  # fmt: skip


def _gate_inputs(hf_model: Any, tokens_BS: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router input (T×H) for a forward of ``tokens_BS``."""
    seen: list[torch.Tensor] = []
    hooks = [
        gate.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).detach())
        )
        for gate in _gates(hf_model)
    ]
    try:
        with torch.no_grad():
            hf_model(tokens_BS)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def _selection_scores(gate: Any, x_TH: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    logits_TE = x_TH.float() @ gate.weight.float().T
    if model.moe_router_score_function == "sigmoid":
        bias_E = getattr(gate, "e_score_correction_bias", None)
        scores_TE = torch.sigmoid(logits_TE)
        return scores_TE + bias_E.float() if bias_E is not None else scores_TE
    return logits_TE


def probe_tokens(model: ModelConfig, seed: int = 0, batch: int = 16, seq: int = 32) -> torch.Tensor:
    """Random token ids (the ids rollouts' prompts are drawn from) to measure routers on."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, min(100, model.vocab_size), (batch, seq), generator=gen)


def scale_routers(
    hf_model: Any, model: ModelConfig, router_std: float = 1.5, seed: int = 0
) -> list[float]:
    """Scale each MoE layer's gate so its router logits' std over experts is
    ``router_std``; returns the factors, one per MoE layer."""
    tokens = probe_tokens(model, seed)
    factors = []
    for i, gate in enumerate(_gates(hf_model)):
        x_TH = _gate_inputs(hf_model, tokens)[i]
        with torch.no_grad():
            std = float((x_TH.float() @ gate.weight.float().T).std(dim=-1).mean())
            factor = router_std / max(std, 1e-12)
            gate.weight.mul_(factor)
        factors.append(factor)
    return factors


def margins(hf_model: Any, model: ModelConfig, seed: int = 1) -> dict[str, Any]:
    """The top-k boundary gap (k-th minus (k+1)-th selection score) per MoE layer:
    ``per_layer`` (percentiles ``PERCENTILES``), ``all`` (pooled) and ``score``."""
    k = model.moe_router_topk
    gaps = []
    for gate, x_TH in zip(_gates(hf_model), _gate_inputs(hf_model, probe_tokens(model, seed))):
        top_TK = _selection_scores(gate, x_TH, model).topk(k + 1, dim=-1).values
        gaps.append((top_TK[:, k - 1] - top_TK[:, k]).numpy())
    pct = lambda g: {f"p{p}": float(np.percentile(g, p)) for p in PERCENTILES}  # noqa: E731
    return {
        "score": "sigmoid+bias" if model.moe_router_score_function == "sigmoid" else "logit",
        "per_layer": [pct(g) for g in gaps],
        "all": pct(np.concatenate(gaps)),
    }


def margin_line(name: str, m: dict[str, Any]) -> str:
    a = m["all"]
    return (
        f"geometry={name} margin ({m['score']} gap, k-th − (k+1)-th) "
        + " ".join(f"p{p}={a[f'p{p}']:.3e}" for p in PERCENTILES)
        + " per_layer_p50=" + ",".join(f"{x['p50']:.3e}" for x in m["per_layer"])
    )  # fmt: skip


@dataclass
class GeometryCheckpoint:
    path: Path
    model: ModelConfig
    router_factors: list[float]
    margins: dict[str, Any]


def save_geometry_checkpoint(
    name: str, out: str | Path, *, seed: int = 0, router_std: float = 1.5
) -> GeometryCheckpoint:
    """A random HF checkpoint of geometry ``name`` with its routers scaled
    (`scale_routers`) and their margins measured."""
    from moerl.models.hf_tiny import build_hf_model
    from moerl.models.tokenizer import build_tiny_tokenizer

    model = geometry_config(name)
    hf_model = build_hf_model(model, seed)
    factors = scale_routers(hf_model, model, router_std, seed)
    found = margins(hf_model, model, seed + 1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(out), safe_serialization=True)
    build_tiny_tokenizer(model.vocab_size).save_pretrained(str(out))
    return GeometryCheckpoint(out, model, factors, found)
