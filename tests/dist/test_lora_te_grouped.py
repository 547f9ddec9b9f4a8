"""LoRA on transformer-engine grouped experts (``TEGroupedMLP``) against SequentialMLP.

transformer-engine cannot be installed here, so the grouped linears are FAKES: classes
named and built like megatron-core's ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (the ``TEGroupedLinear`` wrapper's ``explicit_expert_comm``,
local sizes and ``parallel_mode=None`` under expert parallelism or expert TP, TE's
``num_gemms``, ``in_features``, ``out_features``, ``sequence_parallel``, ``weight{i}`` with
``allreduce``), whose ``forward(x, m_splits)`` runs one plain GEMM per segment and
returns ``(out, None)``. They are plugged into megatron-core's own ``TEGroupedMLP``
(its real forward: fc1, SwiGLU, probabilities, fc2), which replaces every MoE layer's
``SequentialMLP`` in a copy of the model, with the same weights. Nothing here runs TE's
kernels, fp8 or its userbuffers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_lora import B_STD, GRAD_TOL, LOGIT_TOL, _backward, _lora_cfg, _rel, _tokens

from moerl.parallel import spawn


class TEGroupedLinear(torch.nn.Module):
    """What megatron-core's ``TEGroupedLinear`` over TE's ``GroupedLinear`` sets up, on
    plain torch (bias-free, as the tiny models are)."""

    def __init__(  # type: ignore[no-untyped-def]
        self, num_gemms, input_size, output_size, *, parallel_mode, config, init_method,
        bias, skip_bias_add, is_expert=False, tp_comm_buffer_name=None, pg_collection=None,
    ):  # fmt: skip
        super().__init__()
        assert is_expert and not bias
        self.config = config
        self._tp_group = pg_collection.expt_tp
        tp_size = dist.get_world_size(self._tp_group) if self._tp_group is not None else 1
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.explicit_expert_comm = is_expert and (tp_size > 1 or self.expert_parallel)
        if self.explicit_expert_comm:  # the dispatcher communicates; TE sees local sizes
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, tp_size = None, 1
        self.num_gemms, self.parallel_mode, self.tp_size = num_gemms, parallel_mode, tp_size
        self.in_features, self.out_features = input_size, output_size  # TE divides by tp_size=1
        self.sequence_parallel = tp_size > 1 and config.sequence_parallel
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size))
            weight.allreduce = not (is_expert and self.expert_parallel)  # type: ignore[attr-defined]
            self.register_parameter(f"weight{i}", weight)

    def forward(self, x, m_splits):  # type: ignore[no-untyped-def]
        assert isinstance(m_splits, list) and len(m_splits) == self.num_gemms
        pieces = torch.split(x, m_splits)
        out = [F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(pieces)]
        return torch.cat(out), None


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, parallel_mode="column", **kwargs)


class TERowParallelGroupedLinear(TEGroupedLinear):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, parallel_mode="row", **kwargs)


def _te_experts(experts):  # type: ignore[no-untyped-def]
    """megatron-core's TEGroupedMLP on the fake linears, with a SequentialMLP's weights."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    submodules = MLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
    )
    groups = SimpleNamespace(ep=experts.ep_group, expt_tp=experts.tp_group)
    grouped = TEGroupedMLP(experts.num_local_experts, experts.config, submodules, groups)
    with torch.no_grad():
        for i, expert in enumerate(experts.local_experts):
            getattr(grouped.linear_fc1, f"weight{i}").copy_(expert.linear_fc1.weight)
            getattr(grouped.linear_fc2, f"weight{i}").copy_(expert.linear_fc2.weight)
    return grouped


def _models(hf_dir: str, layout: str):  # type: ignore[no-untyped-def]
    from moerl.convert import load_hf
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model

    model = tiny_config("qwen3_moe")
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model, seed=5)
    sequential, te = build_model(model, pcfg), build_model(model, pcfg)
    load_hf(sequential, hf_dir, model)
    load_hf(te, hf_dir, model)
    for layer in te[0].decoder.layers:
        if hasattr(layer.mlp, "local_expert_indices"):
            layer.mlp.experts = _te_experts(layer.mlp.experts)
    return model, sequential, te


def _max_diff(a, b) -> float:  # type: ignore[no-untyped-def]
    return float((a - b).abs().max())


def _te_vs_sequential(hf_dir: str, layouts: tuple[str, ...]) -> None:
    from moerl.checks.conversion import megatron_logits
    from moerl.lora import apply_lora, gather_adapters

    for layout in layouts:
        model, sequential, te = _models(hf_dir, layout)
        tokens = _tokens(model.vocab_size)
        rank0 = dist.get_rank() == 0
        # (a) the fake TEGroupedMLP is the SequentialMLP
        base = megatron_logits(sequential, tokens)
        assert _max_diff(megatron_logits(te, tokens), base) <= LOGIT_TOL, layout
        # (b) the same adapters, LoRA logits and adapter gradients
        count = apply_lora(sequential, _lora_cfg(), model, b_std=B_STD)
        assert apply_lora(te, _lora_cfg(), model, b_std=B_STD) == count
        grouped = [m for m in te[0].modules() if type(m).__name__.endswith("GroupedLinear")]
        assert len(grouped) == 2 * (model.num_layers - model.first_k_dense_replace)
        assert all(len(m._forward_hooks) == 1 for m in grouped)  # one hook, not per expert
        assert all(m.explicit_expert_comm == (layout != "single") for m in grouped)
        ref, got = gather_adapters(sequential, model), gather_adapters(te, model)
        if rank0:  # (c) the same names, in the same order, and the same tensors
            assert list(got) == list(ref) and any(".mlp.experts.7.up_proj." in n for n in got)
            assert all(torch.equal(got[n], ref[n]) for n in ref), layout
        logits = megatron_logits(te, tokens)
        assert _max_diff(logits, base) > 1e-3, "the adapters must matter"
        diff = _max_diff(logits, megatron_logits(sequential, tokens))
        assert diff <= LOGIT_TOL, f"{layout}: LoRA logits differ by {diff:.2e}"
        _backward(sequential, tokens)
        _backward(te, tokens)
        ref = gather_adapters(sequential, model, grads=True)
        got = gather_adapters(te, model, grads=True)
        if rank0:
            live = [n for n, g in ref.items() if ".mlp.experts." in n and g.abs().sum() > 0]
            assert len(live) > 100, len(live)
            worst = max((_rel(got[n], g), n) for n, g in ref.items())
            assert worst[0] <= GRAD_TOL, f"{layout}: {worst[1]} off by {worst[0]:.2e}"


@pytest.mark.parametrize("layouts", [("single",), ("tp2", "ep2")])
def test_te_grouped_experts_match_sequential(layouts, tiny_checkpoints):
    """single: no explicit expert comm; tp2: expert TP 2 (local sizes, all-reduced A of
    fc1 and B of fc2); ep2: expert parallel (global expert indices, allreduce=False)."""
    world = 1 if layouts == ("single",) else 2
    spawn(_te_vs_sequential, world, str(tiny_checkpoints["qwen3_moe"]), layouts)


def _fake(fp8: str | None) -> TEGroupedLinear:
    config = SimpleNamespace(
        fp8=fp8, fp4=None, expert_model_parallel_size=1, sequence_parallel=False
    )
    return TEColumnParallelGroupedLinear(
        2, 8, 16, config=config, init_method=None, bias=False, skip_bias_add=False,
        is_expert=True, pg_collection=SimpleNamespace(expt_tp=None),
    )  # fmt: skip


def test_expert_slice_sizes_and_refusals():
    from moerl.lora.bases import COLUMN, REPLICATED, ExpertSlice, is_te_grouped, parallel_kind

    linear = _fake(None)
    assert is_te_grouped(linear) and not is_te_grouped(torch.nn.Linear(2, 2))
    piece = ExpertSlice(linear, 1, None)
    assert (piece.input_size, piece.output_size) == (8, 16) and piece.weight is linear.weight1
    assert parallel_kind(piece) == (COLUMN, REPLICATED)
    with pytest.raises(NotImplementedError, match="fp8='e4m3'.*use_te=False"):
        ExpertSlice(_fake("e4m3"), 0, None)
