"""The engine's slot KV pool against transformers' own full forward.

Requests of different lengths are prefilled together (rows right-padded, some resuming
after a cached prefix, some in chunks), then decoded together; every logit and route
must equal those of one full forward of each whole sequence with no cache at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_slots_for_tests import Owner, allocated

from moerl.engine.core.kv_pool import KVPool, Plan, Prefix
from moerl.engine.core.model_runner import ModelRunner


@pytest.fixture(scope="module", params=["deepseek_moe", "qwen3_moe"])
def runner(request, tiny_checkpoints) -> ModelRunner:
    return ModelRunner(tiny_checkpoints[request.param])


def full_forward(runner: ModelRunner, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits [S, V] and routes [S, L, K] of one sequence, no cache."""
    with torch.no_grad():
        logits = runner.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    return logits.float(), runner._routes(1, len(tokens))[0]


def _decode_as_full_forward(runner, pool, owners, seqs, rng, steps: int = 3) -> None:  # type: ignore[no-untyped-def]
    """``steps`` decode steps of every owner's slot at once, each row's logits and routes
    those of one full forward of its sequence (``seqs``, extended in place)."""
    for _ in range(steps):
        new = [int(t) for t in rng.integers(3, 100, len(owners))]
        logits_BV, routes_BLK = runner.decode(pool, [o.slot for o in owners], new)
        for b, seq in enumerate(seqs):
            seq.append(new[b])
            want_logits, want_routes = full_forward(runner, seq)
            torch.testing.assert_close(logits_BV[b], want_logits[-1], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(routes_BLK[b], want_routes[-1])


def test_batched_prefill_and_decode_equal_the_full_forward(runner):
    rng = np.random.default_rng(0)
    pool = runner.new_pool(8)
    owners = allocated(pool, 3)
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
    owners = allocated(pool, 3)
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


def test_load_from_gives_each_target_its_sources_prompt(runner):
    """Prompts prefilled in a pool of their own, copied into a running pool's slots in one
    indexed copy per tensor (moerl/engine/core/scheduler.py ``_place``): each target then
    decodes exactly as its source's sequence."""
    rng = np.random.default_rng(2)
    wave = runner.new_pool(2, slots=2, tokens=9)
    leaders = [Owner() for _ in range(2)]
    seqs = [rng.integers(3, 100, n).tolist() for n in (7, 9)]
    for o in leaders:
        wave.alloc(o)
    runner.extend(wave, [o.slot for o in leaders], seqs)
    pool = runner.new_pool(8)
    followers = [Owner() for _ in range(4)]
    for o in followers:
        pool.alloc(o)
    pairs = [(leaders[i % 2].slot, o.slot, len(seqs[i % 2])) for i, o in enumerate(followers)]
    pool.load_from(wave, pairs)  # type: ignore[arg-type]
    assert [pool.length(o.slot) for o in followers] == [7, 9, 7, 9]  # type: ignore[arg-type]
    new = [11, 12, 13, 14]
    logits_BV, _ = runner.decode(pool, [o.slot for o in followers], new)  # type: ignore[misc]
    for b in range(4):
        want, _ = full_forward(runner, [*seqs[b % 2], new[b]])
        torch.testing.assert_close(logits_BV[b], want[-1], rtol=1e-4, atol=1e-4)


def test_slots_reading_shared_prefixes_equal_the_full_forward(runner):
    """Slots that read copies of their prompts (made in two prefill pools, prompts of
    different lengths, four samples on one prompt) decode beside a slot holding all its
    tokens, every logit and route as one full forward of each whole sequence; a slot
    with a prefix also extends by several tokens, moves when another is freed, exports
    prefix + own tokens, and the prompt's KV is held once."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 100, n).tolist() for n in (12, 5, 9)]
    waves, prefixes = [], []
    for group in ((0, 1), (2,)):
        wave = runner.new_pool(2, slots=len(group), tokens=12)
        rows = [Owner() for _ in group]
        for o in rows:
            wave.alloc(o)
        runner.extend(wave, [o.slot for o in rows], [prompts[i] for i in group])
        waves.append(wave)
        prefixes += [
            Prefix(*wave.export(o.slot, len(prompts[i])), len(prompts[i]))  # type: ignore[arg-type]
            for o, i in zip(rows, group)
        ]
    pool = runner.new_pool(8)
    own = Owner()  # a request holding its whole sequence, in the same batch
    pool.alloc(own)
    own_seq = rng.integers(3, 100, 6).tolist()
    runner.extend(pool, [own.slot], [own_seq])  # type: ignore[list-item]
    which = [0, 0, 0, 0, 1, 2]  # four samples of prompt 0, one each of 1 and 2
    owners = [Owner() for _ in which]
    seqs = [list(prompts[i]) for i in which]
    for o, i in zip(owners, which):
        pool.alloc(o)
        pool.attach(o.slot, prefixes[i])  # type: ignore[arg-type]
    assert pool.shared == 6
    # the prompts' KV once (12 + 5 + 9), the own slot's 6
    assert pool.tokens == 12 + 5 + 9 + 6
    # the keys a decode step reads: prompts padded to the longest (12) before the own
    # tokens; columns no prompt fills are zeros (masked, and finite: 0 x NaN is NaN)
    slots = [o.slot for o in [*owners, own]]
    plan = Plan(slots, [pool.length(s) for s in slots], [1] * 7, prefixes=pool.prefixes_of(slots))  # type: ignore[arg-type]
    keys, _ = pool.read(0, plan)
    assert keys.shape[2] == 12 + plan.keys_read
    assert (keys[5, :, 9:12] == 0).all() and (keys[6, :, :12] == 0).all()  # prompt 2; own
    torch.testing.assert_close(keys[4, :, :5], prefixes[1].keys(0))
    everyone = [*owners, own]
    seqs.append(own_seq)
    _decode_as_full_forward(runner, pool, everyone, seqs, rng)
    # a prefixed slot extends by three tokens at once (attention over prefix + own)
    more = rng.integers(3, 100, 3).tolist()
    logits, _ = runner.extend(pool, [owners[4].slot], [more], logits_from=[0])  # type: ignore[list-item]
    seqs[4] += more
    want, _ = full_forward(runner, seqs[4])
    torch.testing.assert_close(logits[0], want[-3:], rtol=1e-4, atol=1e-4)
    # freeing a slot moves the last one (a sample of prompt 2) and keeps its prefix
    pool.free(owners[1])
    assert owners[5].slot == 2 and pool.prefix(2) is prefixes[2]
    keys, values = pool.export(owners[4].slot, len(seqs[4]))  # type: ignore[arg-type]
    assert keys[0].shape[1] == len(seqs[4])
    left = [o for i, o in enumerate(owners) if i != 1]
    kept = [s for i, s in enumerate(seqs[:6]) if i != 1]
    new = [int(t) for t in rng.integers(3, 100, len(left) + 1)]
    logits_BV, _ = runner.decode(pool, [o.slot for o in [*left, own]], new)  # type: ignore[misc]
    for b, seq in enumerate([*kept, seqs[6]]):
        want, _ = full_forward(runner, [*seq, new[b]])
        torch.testing.assert_close(logits_BV[b], want[-1], rtol=1e-4, atol=1e-4)
    # the export is the sequence's KV: a fresh slot loaded with it decodes as the sequence
    fresh = Owner()
    pool.alloc(fresh)
    pool.load(fresh.slot, keys, values)  # type: ignore[arg-type]
    logits_BV, _ = runner.decode(pool, [fresh.slot], [17])  # type: ignore[list-item]
    want, _ = full_forward(runner, [*seqs[4], 17])
    torch.testing.assert_close(logits_BV[0], want[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="attach a prefix first"):
        pool.attach(fresh.slot, prefixes[0])  # type: ignore[arg-type]


def test_slots_reading_held_prefixes_equal_the_full_forward(runner):
    """A prefix that is the first tokens of a longer cached sequence (a prefix-cache
    entry's) is read by a prefill slot, which extends after it; then running slots get
    that slot's own tokens copied and read the prefix too (``load_from``), beside a slot
    reading a prompt's copy, and decode as the full forward."""
    rng = np.random.default_rng(5)
    cached = rng.integers(3, 100, 10).tolist()
    source = runner.new_pool(1, slots=1, tokens=10)
    holder = Owner()
    source.alloc(holder)
    runner.extend(source, [holder.slot], [cached])
    keys, values = source.export(holder.slot, 10)  # type: ignore[arg-type]
    held = Prefix(keys, values, 8)  # the first 8 of the 10 cached tokens
    wave = runner.new_pool(2, slots=2, tokens=12)
    rows = [Owner(), Owner()]
    for o in rows:
        wave.alloc(o)
    wave.attach(rows[0].slot, held)  # type: ignore[arg-type]
    other = rng.integers(3, 100, 6).tolist()
    tail = rng.integers(3, 100, 4).tolist()
    runner.extend(wave, [o.slot for o in rows], [tail, other])  # type: ignore[misc]
    seqs = [cached[:8] + tail, cached[:8] + tail, other]
    pool = runner.new_pool(8)
    owners = [Owner() for _ in seqs]
    for o in owners:
        pool.alloc(o)
    pool.load_from(wave, [(rows[0].slot, owners[0].slot, 12), (rows[0].slot, owners[1].slot, 12)])  # type: ignore[list-item]
    pool.attach(owners[2].slot, Prefix(*wave.export(rows[1].slot, 6), 6))  # type: ignore[arg-type]
    assert pool.prefix(owners[0].slot) is held and pool.tokens == 8 + 2 * 4 + 6  # type: ignore[arg-type]
    _decode_as_full_forward(runner, pool, owners, seqs, rng)


def test_export_many_equals_each_export_and_loads_back(runner):
    """A decode step's finished requests are exported together (moerl/engine/core/scheduler.py
    ``_keep``): slots of different lengths holding their own tokens, one reading a prefix,
    one asked for fewer tokens than it holds and one for none: every export equals the
    slot's own ``export``, bit for bit, and one loaded into a fresh slot decodes as its
    sequence."""
    rng = np.random.default_rng(5)
    pool = runner.new_pool(8)
    owners = allocated(pool, 4)
    seqs = [rng.integers(3, 100, n).tolist() for n in (5, 13, 8, 3)]
    runner.extend(pool, [o.slot for o in owners], seqs)
    wave = runner.new_pool(1, slots=1, tokens=6)
    lead = Owner()
    wave.alloc(lead)
    prompt = rng.integers(3, 100, 6).tolist()
    runner.extend(wave, [lead.slot], [prompt])
    reader = Owner()
    pool.alloc(reader)
    pool.attach(reader.slot, Prefix(*wave.export(lead.slot, 6), 6))  # type: ignore[arg-type]
    runner.extend(pool, [reader.slot], [[7, 8]])  # type: ignore[list-item]
    wanted = [(owners[0].slot, 5), (owners[1].slot, 10), (reader.slot, 8), (owners[2].slot, 8),
              (owners[3].slot, 0), (owners[3].slot, 3)]  # fmt: skip
    got = pool.export_many(wanted)  # type: ignore[arg-type]
    assert len(got) == len(wanted)
    for (slot, n), (keys, values) in zip(wanted, got):
        want_keys, want_values = pool.export(slot, n)  # type: ignore[arg-type]
        assert len(keys) == len(want_keys) == len(values)
        for a, b in zip(keys + values, want_keys + want_values):
            assert a.shape == b.shape and torch.equal(a, b), (slot, n)
    fresh = Owner()
    pool.alloc(fresh)
    keys, values = got[1]
    pool.load(fresh.slot, keys, values)  # type: ignore[arg-type]
    logits_BV, _ = runner.decode(pool, [fresh.slot], [seqs[1][10]])  # type: ignore[list-item]
    want, _ = full_forward(runner, seqs[1][:11])
    torch.testing.assert_close(logits_BV[0], want[-1], rtol=1e-4, atol=1e-4)
    assert pool.export_many([]) == []


def test_a_plan_reads_whole_key_tiles_when_asked():
    """``read_whole_tiles`` widens the keys a forward reads so the prefixes' part and the
    own part together are whole tiles, never past ``most`` own positions and never
    narrower; the mask covers the new keys and masks them for every row."""
    plan = Plan([0, 1], [5, 9], [1, 1])  # own keys read: 10
    plan.read_whole_tiles(16, 1000)
    assert plan.keys_read == 16
    mask = plan.attention_mask(torch.float32, boolean=True)
    assert mask.shape == (2, 1, 1, 16)
    assert mask[0, 0, 0].tolist() == [True] * 6 + [False] * 10
    assert mask[1, 0, 0].tolist() == [True] * 10 + [False] * 6
    capped = Plan([0], [20], [1])  # 21 own keys read, at most 24 allowed
    capped.read_whole_tiles(16, 24)
    assert capped.keys_read == 24
    whole = Plan([0], [31], [1])  # already 32
    whole.read_whole_tiles(16, 1000)
    assert whole.keys_read == 32
    prefix = Prefix([torch.zeros(1, 7, 2)], [torch.zeros(1, 7, 2)], 7)
    shared = Plan([0], [7 + 3], [1], prefixes=[prefix])  # prefix 7 + own 4 = 11
    shared.read_whole_tiles(16, 1000)
    assert (shared.prefix_width, shared.keys_read) == (7, 9)


def test_growth_keeps_the_used_tokens_and_zeroes_every_other_position(runner):
    """A pool that grows copies each used slot's tokens and zeroes the rest, whatever the
    old tensors held there (masked positions are read in place: they must be finite)."""
    pool = KVPool(runner.num_layers, runner.dtype, max_slots=8, max_tokens=128, slots=2, tokens=8)
    owners = allocated(pool, 2)
    runner.extend(pool, [o.slot for o in owners], [[5, 6, 7], [8, 9, 10, 11, 12]])
    kept = [t[:2, :, :5].clone() for t in pool.keys + pool.values]
    for t in pool.keys + pool.values:  # what a stale or failed request could leave
        t[:, :, 5:] = float("nan")
    pool.reserve(5, 20)
    assert (pool.slots, pool.capacity) == (5, 20) and pool.reallocations == 1
    for old, new in zip(kept, pool.keys + pool.values, strict=True):
        assert torch.equal(new[:2, :, :5], old)
        assert torch.count_nonzero(new[:2, :, 5:]) == 0 and torch.count_nonzero(new[2:]) == 0


def test_the_batch_invariant_modes_pools_start_at_whole_key_tiles(tiny_checkpoints):
    """The mode reads keys in whole tiles: a prefill's pool, sized to its prompt, holds
    them from the start instead of growing (copying every layer) at its own forward."""
    from moerl.kernels.batch_invariant import ATTENTION_KEYS

    det = ModelRunner(tiny_checkpoints["deepseek_moe"], deterministic=True)
    pool = det.new_pool(1, slots=1, tokens=5)
    assert pool.capacity == ATTENTION_KEYS
    (owner,) = allocated(pool, 1)
    det.extend(pool, [owner.slot], [[5, 6, 7, 8, 9]])
    assert pool.reallocations == 0
    plain = ModelRunner(tiny_checkpoints["deepseek_moe"]).new_pool(1, slots=1, tokens=5)
    assert plain.capacity == 5  # without the mode: as asked
