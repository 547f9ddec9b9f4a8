"""trainer.expert_gemm: the grouped-GEMM experts (moerl.models.grouped_experts) give
bitwise the results and gradients of megatron-core's SequentialMLP loop on CPU, in one
process and under expert parallelism, and step aside for hooked experts (LoRA)."""

from __future__ import annotations

import pytest
import torch

from moerl.models.grouped_experts import use_grouped
from moerl.parallel import spawn


def _forward_backward(chunks, tokens, weights):  # type: ignore[no-untyped-def]
    """Logits of ``tokens`` and the gradients of sum(logits · weights), by name."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    for chunk in chunks:
        chunk.zero_grad()
    logits = chunks[0](tokens, positions, None)
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare(hf_dir: str, layout: str) -> None:
    import torch.nn.functional as F

    from moerl.convert import load_hf
    from moerl.models.grouped_experts import GroupedSequentialMLP
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import initialize_model_parallel, parse_layout

    calls = {"n": 0}
    real = F.grouped_mm

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*args, **kwargs)

    F.grouped_mm = counted  # counts torch's kernel calls; the computation is torch's own
    model = tiny_config("deepseek_moe")
    pcfg, _ = parse_layout(layout)
    initialize_model_parallel(pcfg, num_layers=4, num_attention_heads=4, num_experts=8)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (3, 11), generator=gen)
    for dtype in ("fp32", "bf16"):
        built = {}
        for gemm in ("loop", "grouped"):
            chunks = build_model(model, pcfg, dtype, expert_gemm=gemm)
            load_hf(chunks, hf_dir, model)
            built[gemm] = chunks
        experts = [m for m in built["grouped"][0].modules() if isinstance(m, GroupedSequentialMLP)]
        assert experts and not any(
            isinstance(m, GroupedSequentialMLP) for m in built["loop"][0].modules()
        )
        weights = torch.randn(3, 11, model.vocab_size, generator=gen)
        before = calls["n"]
        ref_logits, ref_grads = _forward_backward(built["loop"], tokens, weights)
        assert calls["n"] == before  # the loop never calls the grouped kernel
        logits, grads = _forward_backward(built["grouped"], tokens, weights)
        # per MoE layer two grouped GEMMs forward (backward: torch's own, or ours)
        full = calls["n"] - before
        assert full >= 2 * len(experts) and full % len(experts) == 0, (full, len(experts))
        assert torch.equal(logits, ref_logits), (dtype, (logits - ref_logits).abs().max())
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            assert torch.equal(grads[name], ref_grads[name]), (dtype, name)
        # a hook on an expert (LoRA's adapters hook them) sends the forward through the loop
        seen = []
        fc1 = experts[0].local_experts[0].linear_fc1
        handle = fc1.register_forward_hook(lambda *_: seen.append(1))
        before = calls["n"]
        hooked, _ = _forward_backward(built["grouped"], tokens, weights)
        handle.remove()
        assert seen and calls["n"] - before == full - full // len(experts)
        assert torch.equal(hooked, ref_logits)


@pytest.mark.parametrize("layout,world", [("single", 1), ("ep2", 2)])
def test_grouped_experts_are_bitwise_the_loop(tiny_checkpoints, layout, world):
    spawn(_compare, world, str(tiny_checkpoints["deepseek_moe"]), layout)


def test_expert_gemm_choice():
    assert use_grouped("auto", has_cuda=False) and not use_grouped("auto", has_cuda=True)
    assert use_grouped("grouped", has_cuda=True) and not use_grouped("loop", has_cuda=False)
    with pytest.raises(ValueError, match="trainer.expert_gemm"):
        use_grouped("fast", has_cuda=False)
