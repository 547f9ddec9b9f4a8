"""moerl/trainer/numerics.py: a matched router computes in the batch-invariant mode only
its logits' product and its scores' formula (``gating`` and megatron-core's routing
function); the rest of its forward (aux losses, the expert bias's token counts) runs
outside it. Its probabilities and routing map must be the bits of the whole forward run
inside the mode, as the router ran before (training mode, so the aux losses run too), for
both families' routers: DeepSeek's sigmoid with groups and an expert bias in fp32, and
Qwen3-MoE's renormalised softmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moerl.parallel import spawn


def _compare(hf_dir: str) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    from moerl.checks.replay import checkpoint_model, parse_layout
    from moerl.convert import load_hf
    from moerl.kernels import batch_invariant as bi
    from moerl.models.gpt import build_model
    from moerl.parallel.state import initialize_for_model
    from moerl.trainer import numerics

    # the tiny configs train without aux losses; real ones (conf/model) weigh them
    model = dataclasses.replace(checkpoint_model(hf_dir), moe_aux_loss_coeff=1e-3)
    pcfg, _ = parse_layout("single")
    initialize_for_model(pcfg, model)
    chunks = build_model(model, pcfg, "fp32", routing_replay=False, use_te=False)
    load_hf(chunks, hf_dir, model)
    numerics.enable(chunks, model.family)
    routers = [m for m in chunks[0].modules() if isinstance(m, TopKRouter)]
    assert routers
    gen = torch.Generator().manual_seed(0)
    for router in routers:
        router.train()
        assert router.is_aux_loss_enabled()  # the part now outside the mode runs
        hidden = torch.randn(7, 3, model.hidden_size, generator=gen)  # [S, B, H]
        probs, routing_map = router(hidden)
        assert not bi.in_mode()
        patched = {k: router.__dict__.pop(k) for k in ("gating", "routing")}
        try:  # the router as it ran before: its whole forward in the mode
            with bi.BatchInvariant():
                want_probs, want_map = router(hidden)
        finally:
            router.__dict__.update(patched)
        assert torch.equal(routing_map, want_map)
        assert torch.equal(probs, want_probs), (probs - want_probs).abs().max()


@pytest.mark.parametrize("family", ["deepseek_moe", "qwen3_moe"])
def test_a_matched_router_gives_the_whole_forward_in_the_modes_bits(tiny_checkpoints, family):
    spawn(_compare, 1, str(tiny_checkpoints[family]))
