"""MLA decode steps in absorbed form (moerl/engine/core/mla.py) against transformers' own
path: the same model and pool, decoded once absorbed and once through transformers'
``DeepseekV3Attention.forward`` (``ModelRunner.absorb_mla`` off), and against one full
forward of each whole sequence with no cache (transformers' prefill path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_slots_for_tests import allocated

from moerl.engine.core import mla
from moerl.engine.core.model_runner import ModelRunner


def _expansions(runner: ModelRunner) -> list[int]:
    """A counter of transformers' ``expand_kv`` calls (the step absorption skips)."""
    calls = [0]
    for module in runner.model.modules():
        if mla.absorbable(module):
            expand = module.expand_kv

            def counted(*args, expand=expand, **kwargs):  # type: ignore[no-untyped-def]
                calls[0] += 1
                return expand(*args, **kwargs)

            module.expand_kv = counted
    return calls


def _decode_run(
    runner: ModelRunner, absorb: bool, calls: list[int], steps: int = 4
) -> tuple[list[torch.Tensor], int]:
    """Three rows of different lengths prefilled together (one after a cached prefix),
    then ``steps`` decode steps: the decode logits [B, V] of each step, and how many
    times the decode steps expanded the latents (``calls``: ``_expansions``' counter)."""
    rng = np.random.default_rng(0)
    pool = runner.new_pool(8)
    owners = allocated(pool, 3)
    seqs = [rng.integers(3, 100, n).tolist() for n in (5, 19, 11)]
    slots = [o.slot for o in owners]
    runner.extend(pool, [slots[1]], [seqs[1][:7]])
    runner.extend(pool, slots, [seqs[0], seqs[1][7:], seqs[2]])
    runner.absorb_mla = absorb
    out, before = [], calls[0]
    for _ in range(steps):
        new = [int(t) for t in rng.integers(3, 100, 3)]
        out.append(runner.decode(pool, slots, new)[0])
        for seq, token in zip(seqs, new):
            seq.append(token)
    expanded = calls[0] - before
    with torch.no_grad():  # the last step against one full forward of each sequence
        for b, seq in enumerate(seqs):
            want = runner.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            tol = 1e-4 if runner.dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[-1][b], want.float(), rtol=tol, atol=tol)
    return out, expanded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_absorbed_decode_equals_transformers_path(tiny_checkpoints, dtype):
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"], dtype=dtype)
    assert runner.absorbed == runner.num_layers
    calls = _expansions(runner)
    absorbed, n = _decode_run(runner, True, calls)
    assert n == 0
    expanded, n = _decode_run(runner, False, calls)
    assert n == 4 * runner.num_layers  # transformers' path: every step, every layer
    tol = 1e-5 if dtype == "float32" else 3e-2
    for a, e in zip(absorbed, expanded):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


def test_additive_masks_of_eager_attention(tiny_checkpoints):
    """With transformers' eager attention the engine's masks are additive floats."""
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"])
    runner.model.set_attn_implementation("eager")
    runner.sdpa = False
    calls = _expansions(runner)
    absorbed, n = _decode_run(runner, True, calls)
    assert n == 0
    expanded, n = _decode_run(runner, False, calls)
    assert n == 4 * runner.num_layers
    for a, e in zip(absorbed, expanded):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_not_taken_where_it_would_change_what_the_engine_promises(tiny_checkpoints):
    from moerl.engine.lora.adapters import LoraManager

    # batch-invariant mode: the trainer's op order, transformers' expanded attention
    assert ModelRunner(tiny_checkpoints["deepseek_moe"], deterministic=True).absorbed == 0
    # no MLA in Qwen3-MoE
    assert ModelRunner(tiny_checkpoints["qwen3_moe"]).absorbed == 0
    # with LoRA an adapter may sit on kv_b_proj, the weight absorption folds
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"])
    runner.lora = LoraManager(runner.model, max_rank=8)
    _, n = _decode_run(runner, True, _expansions(runner), steps=2)
    assert n == 2 * runner.num_layers


def test_without_a_query_latent(tmp_path):
    """DeepSeek-V2-Lite's layout: the query from one projection (``q_lora_rank`` None)."""
    import dataclasses

    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config("deepseek_moe"), q_lora_rank=None)
    runner = ModelRunner(save_tiny_checkpoint(cfg, tmp_path / "no-q-lora"))
    assert runner.model.model.layers[0].self_attn.q_proj is not None
    calls = _expansions(runner)
    absorbed, n = _decode_run(runner, True, calls)
    assert n == 0
    expanded, _ = _decode_run(runner, False, calls)
    for a, e in zip(absorbed, expanded):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
