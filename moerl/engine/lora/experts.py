"""Per-expert LoRA on transformers' fused routed experts.

transformers 5.x stores a MoE layer's routed experts as two 3-D parameters,
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], so
there is no ``nn.Linear`` per expert to hook. A PEFT adapter names them per expert
(``…mlp.experts.{i}.{gate,up,down}_proj.lora_{A,B}.weight``, SGLang's convention);
they are validated and stacked here into [E, r, in] / [E, out, r] per projection, and
the experts module's forward is wrapped: tokens of batch rows whose request named an
adapter run an expert loop that adds ``scaling · B_i(A_i x)`` to expert i's gate, up
and down projections; all other tokens run transformers' own experts forward.

Coverage rule: an adapter holding routed-expert tensors for a projection (gate_proj,
up_proj or down_proj) must hold lora_A and lora_B of that projection for every expert
0..E−1 of every MoE layer — of the layers in its ``layers_to_transform`` when the
config names them. A gather that dropped an EP rank's experts is refused, never
served half-adapted.
"""

# T tokens, H hidden, I expert intermediate, E experts, K top-k, r rank, N batch rows

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

PROJS = ("gate_proj", "up_proj", "down_proj")
EXPERT_MODULE = re.compile(
    r"^(?P<experts>model\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# experts-module name → projection → (A [E, r, in], B [E, out, r])
ExpertWeights = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]


def fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """experts-module name → module, for fused experts in transformers' default layout
    (gate and up concatenated, not transposed, no bias)."""
    found = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.nn.Parameter) or not isinstance(down, torch.nn.Parameter):
            continue
        if gate_up.dim() != 3 or down.dim() != 3:
            continue
        if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
            continue
        if not getattr(module, "is_concatenated", True):
            continue
        found[name] = module
    return found


def _fused(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of a fused experts module."""
    return cast(torch.Tensor, module.gate_up_proj), cast(torch.Tensor, module.down_proj)


def _in_out(module: torch.nn.Module, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of one expert's projection."""
    _, two_i, hidden = _fused(module)[0].shape
    inter = two_i // 2
    return (inter, hidden) if proj == "down_proj" else (hidden, inter)


def stack_expert_weights(
    adapter: str,
    pairs: dict[str, dict[str, torch.Tensor]],
    experts: dict[str, torch.nn.Module],
    rank: int,
    layers_to_transform: list[int] | None,
) -> ExpertWeights:
    """Validate the routed-expert pairs (module name → {"A", "B"}) of one adapter and
    stack them per experts module and projection. Raises ValueError in user words."""
    by_proj: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for module, pair in pairs.items():
        match = EXPERT_MODULE.match(module)
        assert match is not None, module  # the caller routes only matching names here
        parent, expert, proj = match["experts"], int(match["expert"]), match["proj"]
        fused = experts.get(parent)
        if fused is None:
            raise ValueError(
                f"adapter {adapter!r}: {module}: layer {match['layer']} of the engine's model "
                f"has no routed experts (a dense layer?)"
            )
        num = _fused(fused)[0].shape[0]
        if not 0 <= expert < num:
            raise ValueError(
                f"adapter {adapter!r}: {module}: expert index {expert} is out of range, "
                f"{parent} has {num} experts (0..{num - 1})"
            )
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {adapter!r}: {module} needs both lora_A and lora_B")
        fan_in, fan_out = _in_out(fused, proj)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise ValueError(
                f"adapter {adapter!r}: {module} lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit a {fan_in}→{fan_out} expert projection at "
                f"rank {rank}"
            )
        by_proj.setdefault((parent, proj), {})[expert] = pair
    layers = None if layers_to_transform is None else set(layers_to_transform)
    required = [
        name
        for name in experts
        if layers is None or int(_LAYER.match(name).group(1)) in layers  # type: ignore[union-attr]
    ]
    out: ExpertWeights = {}
    for proj in sorted({p for _, p in by_proj}):
        for parent in required:
            num = _fused(experts[parent])[0].shape[0]
            have = by_proj.get((parent, proj), {})
            missing = [i for i in range(num) if i not in have]
            if missing:
                raise ValueError(
                    f"adapter {adapter!r}: {proj} LoRA is missing for experts {missing} of "
                    f"{parent} ({len(have)} of {num} present); a per-expert adapter must "
                    f"cover every expert of every MoE layer"
                    + ("" if layers is None else " in its layers_to_transform")
                )
            like = _fused(experts[parent])[0]  # the experts' dtype and device
            a_ErI = torch.stack([have[i]["A"] for i in range(num)]).to(like)
            b_EOr = torch.stack([have[i]["B"] for i in range(num)]).to(like)
            out.setdefault(parent, {})[proj] = (a_ErI, b_EOr)
    extra = sorted({parent for parent, _ in by_proj} - set(required))
    if extra:
        raise ValueError(
            f"adapter {adapter!r}: has routed-expert LoRA for {extra}, outside its "
            f"layers_to_transform {sorted(layers or [])}"
        )
    return out


def lora_experts_forward(
    module: torch.nn.Module,
    x_TH: torch.Tensor,
    index_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> torch.Tensor:
    """transformers' eager experts forward, with ``scaling · B_e(A_e x)`` added to the
    projections of expert e that ``lora`` holds."""

    def delta(proj: str, e: int, h: torch.Tensor) -> torch.Tensor | None:
        pair = lora.get(proj)
        if pair is None:
            return None
        return scaling * F.linear(F.linear(h, pair[0][e]), pair[1][e])

    out_TH = torch.zeros_like(x_TH)
    gate_up_EIH, down_EHI = _fused(module)
    act = cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn)
    num = gate_up_EIH.shape[0]
    for e in torch.unique(index_TK).tolist():
        if not 0 <= e < num:  # transformers' sentinel for masked-out slots
            continue
        tok, slot = torch.where(index_TK == e)
        x = x_TH[tok]
        gate, up = F.linear(x, gate_up_EIH[e]).chunk(2, dim=-1)
        d_gate, d_up = delta("gate_proj", e, x), delta("up_proj", e, x)
        gate = gate if d_gate is None else gate + d_gate
        up = up if d_up is None else up + d_up
        h = act(gate) * up
        y = F.linear(h, down_EHI[e])
        d_down = delta("down_proj", e, h)
        y = y if d_down is None else y + d_down
        y = y * weights_TK[tok, slot, None]
        out_TH.index_add_(0, tok, y.to(out_TH.dtype))
    return out_TH


def wrap_experts(
    module: torch.nn.Module,
    active: Callable[[int], list[tuple[torch.Tensor, dict[str, Any], float]]],
) -> None:
    """Replace ``module.forward``: ``active(T)`` gives, for this forward, each adapter's
    token indices, its projections on this module and its scaling (tokens of different
    adapters are disjoint); the remaining tokens run the original forward."""
    original = module.forward

    def forward(
        x_TH: torch.Tensor,
        index_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        groups = active(x_TH.shape[0])
        if not groups:
            return original(x_TH, index_TK, weights_TK, *args, **kwargs)
        out_TH = torch.empty_like(x_TH)
        base = torch.ones(x_TH.shape[0], dtype=torch.bool, device=x_TH.device)
        for tok, lora, scaling in groups:
            tok = tok.to(x_TH.device)
            base[tok] = False
            y = lora_experts_forward(
                module, x_TH[tok], index_TK[tok], weights_TK[tok], lora, scaling
            )
            out_TH[tok] = y
        if bool(base.any()):
            rest = base.nonzero().squeeze(1)
            out_TH[rest] = original(x_TH[rest], index_TK[rest], weights_TK[rest], *args, **kwargs)
        return out_TH

    module.forward = forward
