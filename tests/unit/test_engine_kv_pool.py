"""The engine's slot KV pool against transformers' own full forward.

Requests of different lengths are prefilled together (rows right-padded, some resuming
after a cached prefix, some in chunks), then decoded together; every logit and route
must equal those of one full forward of each whole sequence with no cache at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.engine.core.kv_pool import KVPool
from moerl.engine.core.model_runner import ModelRunner


class Owner:
    def __init__(self) -> None:
        self.slot: int | None = None


@pytest.fixture(scope="module", params=["deepseek_moe", "qwen3_moe"])
def runner(request, tiny_checkpoints) -> ModelRunner:
    return ModelRunner(tiny_checkpoints[request.param])


def full_forward(runner: ModelRunner, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits [S, V] and routes [S, L, K] of one sequence, no cache."""
    with torch.no_grad():
        logits = runner.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    return logits.float(), runner._routes(1, len(tokens))[0]


def test_batched_prefill_and_decode_equal_the_full_forward(runner):
    rng = np.random.default_rng(0)
    pool = runner.new_pool(8)
    owners = [Owner() for _ in range(3)]
    for o in owners:
        pool.alloc(o)
    seqs = [rng.integers(3, 100, n).tolist() for n in (5, 19, 11)]
    # row 1 arrives with 7 tokens already in its slot (a prefix-cache hit)
    runner.extend(pool, [owners[1].slot], [seqs[1][:7]])
    logits, routes = runner.extend(
        pool,
        [o.slot for o in owners],
        [seqs[0], seqs[1][7:], seqs[2]],
        logits_from=[None, 3, None],  # row 1: logits of its positions 7+3.. as well
    )
    for b, (seq, got, rows) in enumerate(zip(seqs, logits, routes)):
        want_logits, want_routes = full_forward(runner, seq)
        if b == 1:
            torch.testing.assert_close(got, want_logits[10:], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(rows, want_routes[7:])
        else:
            torch.testing.assert_close(got, want_logits[-1], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(rows, want_routes)
    for _ in range(4):  # decode: all rows at once, each at its own position
        new = [int(t) for t in rng.integers(3, 100, 3)]
        logits_BV, routes_BLK = runner.decode(pool, [o.slot for o in owners], new)
        for b in range(3):
            seqs[b].append(new[b])
            want_logits, want_routes = full_forward(runner, seqs[b])
            torch.testing.assert_close(logits_BV[b], want_logits[-1], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(routes_BLK[b], want_routes[-1])
    assert [pool.length(o.slot) for o in owners] == [len(s) for s in seqs]


def test_free_moves_the_last_slot_and_keeps_its_tokens(runner):
    rng = np.random.default_rng(1)
    pool = runner.new_pool(4)
    owners = [Owner() for _ in range(3)]
    seqs = [rng.integers(3, 100, n).tolist() for n in (6, 9, 4)]
    for o, seq in zip(owners, seqs):
        pool.alloc(o)
        runner.extend(pool, [o.slot], [seq])
    pool.free(owners[0], wipe=True)
    assert owners[0].slot is None and owners[2].slot == 0 and owners[1].slot == 1
    assert pool.used == 2 and pool.tokens == 13
    new = [7, 8]
    logits_BV, _ = runner.decode(pool, [owners[2].slot, owners[1].slot], new)
    for b, seq in enumerate((seqs[2], seqs[1])):
        want, _ = full_forward(runner, [*seq, new[b]])
        torch.testing.assert_close(logits_BV[b], want[-1], rtol=1e-4, atol=1e-4)


def test_chunks_and_growth_equal_one_forward(runner):
    """A long row in three forwards, through reallocations of both pool dimensions."""
    rng = np.random.default_rng(2)
    pool = KVPool(runner.num_layers, runner.dtype, max_slots=8, max_tokens=128, slots=1, tokens=4)
    owners = [Owner() for _ in range(3)]
    for o in owners:
        pool.alloc(o)
    seq = rng.integers(3, 100, 40).tolist()
    for lo, hi in ((0, 13), (13, 30), (30, 40)):
        logits, routes = runner.extend(pool, [owners[2].slot], [seq[lo:hi]])
    assert pool.reallocations >= 3 and pool.capacity >= 40
    want_logits, want_routes = full_forward(runner, seq)
    torch.testing.assert_close(logits[0], want_logits[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(routes[0], want_routes[30:])


def test_a_wiped_slot_does_not_poison_its_next_owner(runner):
    """NaN left in a freed slot would reach the next request through masked positions."""
    pool = runner.new_pool(4)
    a, b = Owner(), Owner()
    pool.alloc(a)
    pool.alloc(b)
    runner.extend(pool, [a.slot, b.slot], [[5] * 20, [6] * 3])
    for tensor in pool.values:
        tensor[a.slot].fill_(float("nan"))  # what a request with NaN weights leaves
    pool.free(a, wipe=True)
    c = Owner()
    pool.alloc(c)
    runner.extend(pool, [c.slot], [[9, 10]])
    logits, _ = runner.decode(pool, [b.slot, c.slot], [7, 11])
    assert torch.isfinite(logits).all()
    want, _ = full_forward(runner, [9, 10, 11])
    torch.testing.assert_close(logits[1], want[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="exceed the KV pool"):
        pool.reserve(1, pool.max_tokens + 1)


def test_copy_slots_gives_each_target_its_sources_sequence(runner):
    """Batched follower copies (moerl/engine/core/scheduler.py _copy_leaders): each target
    then decodes exactly as its source's sequence, as one copy_slot each would."""
    rng = np.random.default_rng(2)
    pool = runner.new_pool(8)
    leaders = [Owner() for _ in range(2)]
    seqs = [rng.integers(3, 100, 7).tolist() for _ in leaders]
    for o, seq in zip(leaders, seqs):
        pool.alloc(o)
        runner.extend(pool, [o.slot], [seq])
    followers = [Owner() for _ in range(4)]
    for o in followers:
        pool.alloc(o)
    sources = [leaders[i % 2].slot for i in range(4)]
    pool.copy_slots(sources, [o.slot for o in followers], 7)  # type: ignore[arg-type]
    assert [pool.length(o.slot) for o in followers] == [7] * 4  # type: ignore[arg-type]
    new = [11, 12, 13, 14]
    logits_BV, _ = runner.decode(pool, [o.slot for o in followers], new)  # type: ignore[misc]
    for b in range(4):
        want, _ = full_forward(runner, [*seqs[b % 2], new[b]])
        torch.testing.assert_close(logits_BV[b], want[-1], rtol=1e-4, atol=1e-4)
