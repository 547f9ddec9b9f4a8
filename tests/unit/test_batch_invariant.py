"""kernels/batch_invariant.py: each op agrees with torch's own (to rounding), and a row's
result has the same bits whatever surrounds it: the rows beside it and their number,
its position, padding, masked keys, prefill vs decode."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moerl.kernels import batch_invariant as bi

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_tree_sum_and_mean_match_torch_and_ignore_the_rows_beside():
    x = torch.randn(37, 1000, generator=_gen())
    torch.testing.assert_close(bi.tree_sum(x, -1), x.sum(-1))
    torch.testing.assert_close(bi.tree_sum(x, 0, keepdim=True), x.sum(0, keepdim=True))
    torch.testing.assert_close(bi.mean(x, -1, keepdim=True), x.mean(-1, keepdim=True))
    whole = bi.tree_sum(x, -1)
    for i in (0, 5, 36):
        assert torch.equal(bi.tree_sum(x[i : i + 1], -1), whole[i : i + 1])
    # bf16 sums in fp32
    assert bi.tree_sum(x.bfloat16(), -1).dtype == torch.float32
    assert bi.tree_sum(torch.ones(0, 3), 0).tolist() == [0.0, 0.0, 0.0]


def test_fold_sum_is_unchanged_by_zeros_anywhere():
    x = torch.randn(3, 50, generator=_gen(1))
    ref = bi.fold_sum(x, -1)
    torch.testing.assert_close(ref, x.sum(-1))
    for seed in range(5):
        total = 50 + 7 * (seed + 1)
        where = torch.randperm(total, generator=_gen(seed))[:50].sort().values
        spread = torch.zeros(3, total)
        spread[:, where] = x
        assert torch.equal(bi.fold_sum(spread, -1), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 96), (300, 50), (1024, 1024)])
def test_linear_gives_a_row_the_same_bits_in_any_batch(dtype, k, n):
    w = torch.randn(n, k, generator=_gen(2)).to(dtype)
    b = torch.randn(n, generator=_gen(3)).to(dtype)
    x = torch.randn(70, k, generator=_gen(4)).to(dtype)
    whole = bi.linear(x, w, b)
    _close(whole, F.linear(x, w, b), dtype)
    for start, m in [(0, 1), (0, 2), (3, 1), (5, 7), (9, 16), (1, 33), (20, 50)]:
        assert torch.equal(bi.linear(x[start : start + m], w, b), whole[start : start + m])
    # leading dims are kept; an empty input gives an empty output
    assert bi.linear(x.view(7, 10, k), w).shape == (7, 10, n)
    assert bi.linear(x[:0], w).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmaxes_match_torch_and_a_row_alone(dtype):
    x = (torch.randn(6, 40000, generator=_gen(5)) * 4).to(dtype)
    x[2, :100] = -math.inf
    _close(bi.softmax(x, -1), torch.softmax(x.float(), -1), dtype)
    _close(bi.log_softmax(x.float(), -1), torch.log_softmax(x.float(), -1), torch.float32)
    _close(bi.logsumexp(x, -1), torch.logsumexp(x.float(), -1).to(dtype), dtype)
    assert bi.softmax(x, -1, dtype=torch.float32).dtype == torch.float32
    for op in (bi.softmax, bi.log_softmax):
        whole = op(x, -1)
        for i in range(6):
            assert torch.equal(op(x[i : i + 1], -1), whole[i : i + 1])
    masked = torch.full((1, 4), -math.inf)
    assert torch.equal(bi.softmax(masked, -1).isnan(), torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_softmax_shift_is_the_max_or_zero_where_the_max_is_not_finite(dtype):
    x = torch.tensor(
        [[1.0, 3.0, -2.0], [-math.inf] * 3, [0.5, math.inf, 1.0], [math.nan, 1.0, 2.0]]
    ).to(dtype)
    got = bi._finite_max(x, -1)
    assert got.dtype == dtype and got.shape == (4, 1)
    assert got[:, 0].tolist() == [3.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_do_not_depend_on_the_position_in_the_buffer(dtype):
    """torch's fp32 sigmoid/silu and bf16 rsqrt take a vector path or a scalar one by an
    element's position; these do not."""
    x = (torch.randn(4096, generator=_gen(6)) * 3).to(dtype)
    for op, ref in (
        (bi.sigmoid, torch.sigmoid),
        (bi.silu, F.silu),
        (lambda t: bi.rsqrt(t.abs() + 1), lambda t: torch.rsqrt(t.abs() + 1)),
    ):
        whole = op(x)
        _close(whole, ref(x.float()).to(dtype), dtype)
        for start in range(0, 40, 3):
            for n in (1, 3, 9, 17, 33):
                assert torch.equal(op(x[start : start + n]), whole[start : start + n])


def _attention_inputs(dtype, heads=4, kv_heads=2, t=13, d=24, dv=16):
    g = _gen(7)
    q = torch.randn(1, heads, t, d, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, t, d, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, t, dv, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_sdpa(dtype):
    q, k, v = _attention_inputs(dtype)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    _close(bi.attention(q, k, v, is_causal=True, enable_gqa=True), ref.to(dtype), dtype)
    keep = torch.rand(1, 1, 13, 13, generator=_gen(8)) > 0.3
    keep[..., 0] = True
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=keep)
    _close(bi.attention(q, kr, vr, attn_mask=keep), ref.to(dtype), dtype)
    additive = torch.zeros(1, 1, 13, 13).masked_fill(~keep, -1e30)
    _close(bi.attention(q, kr, vr, attn_mask=additive, scale=0.3),
           F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=additive,
                                          scale=0.3).to(dtype), dtype)  # fmt: skip


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("t", [13, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_the_same_bits_in_prefill_decode_padded_and_beside_a_prefix(
    dtype, t, kv_heads
):
    """Every query of a causal prefill; the last one decoded alone over the keys; its keys
    left-padded as a batched forward pads them; its keys split into a prompt prefix and
    its own tokens with masked zero columns between (the engine's shared prompt read);
    and batched beside another sequence. 40 tokens span several query and key tiles; with
    2 kv heads for 4 query heads, a kv head's query heads share its tiles."""
    q, k, v = _attention_inputs(dtype, kv_heads=kv_heads, t=t)
    prefill = bi.attention(q, k, v, is_causal=True)
    for i in (0, 5, t - 1):  # a query alone over its keys: another row in another tile
        alone = bi.attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1])
        assert torch.equal(alone, prefill[:, :, i : i + 1])
    last = q[:, :, -1:]
    assert torch.equal(bi.attention(last, k, v), prefill[:, :, -1:])
    pad = 5
    kp = torch.cat([torch.zeros(1, kv_heads, pad, 24, dtype=dtype), k], dim=2)
    vp = torch.cat([torch.zeros(1, kv_heads, pad, 16, dtype=dtype), v], dim=2)
    keep = torch.ones(1, 1, 1, t + pad, dtype=torch.bool)
    keep[..., :pad] = False
    assert torch.equal(bi.attention(last, kp, vp, attn_mask=keep), prefill[:, :, -1:])
    gap = 3
    zk, zv = (torch.zeros(1, kv_heads, gap, d, dtype=dtype) for d in (24, 16))
    kg = torch.cat([k[:, :, :8], zk, k[:, :, 8:]], dim=2)
    vg = torch.cat([v[:, :, :8], zv, v[:, :, 8:]], dim=2)
    keep = torch.ones(1, 1, 1, t + gap, dtype=torch.bool)
    keep[..., 8 : 8 + gap] = False
    assert torch.equal(bi.attention(last, kg, vg, attn_mask=keep), prefill[:, :, -1:])
    other_q, other_k, other_v = (x.roll(1, dims=2) * 0.5 for x in (q, k, v))
    both = bi.attention(
        torch.cat([other_q, q]), torch.cat([other_k, k]), torch.cat([other_v, v]),
        is_causal=True,
    )  # fmt: skip
    assert torch.equal(both[1:], prefill)


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_read_in_place_from_a_pool_give_the_copied_keys_bits(dtype):
    """Keys and values read as the engine's KV pool hands them over in the mode: a
    strided view of [slots, heads, capacity, D] up to whole ATTENTION_KEYS tiles, with
    stale (finite) values past each row's own keys, masked. Each key tile's values are
    then multiplied in place (no copy of the values); the bits equal those of the same
    keys copied, without the stale positions, and of each row alone."""
    g = _gen(11)
    slots, heads, capacity, d, dv, rows = 6, 2, 40, 24, 16, 4
    lengths = [9, 17, 30, 4]  # keys read: 30, as two whole tiles of 16
    pool_k = torch.randn(slots, heads, capacity, d, generator=g).to(dtype)
    pool_v = torch.randn(slots, heads, capacity, dv, generator=g).to(dtype)
    q = torch.randn(rows, heads, 1, d, generator=g).to(dtype)
    read = -(-max(lengths) // bi.ATTENTION_KEYS) * bi.ATTENTION_KEYS
    k, v = pool_k[:rows, :, :read], pool_v[:rows, :, :read]
    assert not v.is_contiguous()
    keep = torch.arange(read)[None, :] < torch.tensor(lengths)[:, None]
    mask = keep[:, None, None, :]
    in_place = bi.attention(q, k, v, attn_mask=mask)
    copied = bi.attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
    assert torch.equal(in_place, copied)
    for b, n in enumerate(lengths):  # alone, over its own keys only
        alone = bi.attention(q[b : b + 1], pool_k[b : b + 1, :, :n], pool_v[b : b + 1, :, :n])
        assert torch.equal(in_place[b : b + 1], alone)


def test_attention_takes_tiles_for_prefix_masks_and_folds_for_others():
    """Causal, padded and gapped masks leave every query a prefix of its row's seen keys
    (the tiled path); a block-diagonal (packed) mask does not (the folded path). Both
    are attention: close to sdpa in fp32."""
    q, k, v = _attention_inputs(torch.float32, kv_heads=4, t=24)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    assert bi._key_plan(causal, 1, 4, 24, 24) is not None
    gapped = causal.clone()
    gapped[:, 3:5] = False  # no query sees keys 3 and 4: they are dropped
    index, counts = bi._key_plan(gapped, 1, 4, 24, 24)
    assert index.tolist() == [[0, 1, 2, *range(5, 24)]] and counts[0, 0, -1] == 22
    block = causal.clone()
    block[12:, :12] = False  # two packed sequences of 12
    assert bi._key_plan(block, 1, 4, 24, 24) is None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block)
    _close(bi.attention(q, k, v, attn_mask=block), ref, torch.float32)


@pytest.mark.parametrize("every_expert", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_match_a_loop_and_a_token_alone(monkeypatch, dtype, every_expert):
    if not every_expert:  # each token through its own experts' tiles only
        monkeypatch.setattr(bi, "DENSE_EXTRA_MACS", -1)
    g = _gen(9)
    tokens, hidden, inter, experts, topk = 21, 32, 16, 6, 3
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=g)
    out = bi.experts(x, ids, weights, gate_up, down, bi.silu)
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(topk):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ gate_up[e].float().T).chunk(2)
            ref[t] += weights[t, j] * ((F.silu(gate) * up) @ down[e].float().T)
    _close(out, ref.to(dtype), dtype)
    for t in (0, 7, 20):
        alone = bi.experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate_up, down, bi.silu)
        assert torch.equal(alone, out[t : t + 1])
        # the order of a token's top-k does not matter
        flipped = bi.experts(
            x[t : t + 1], ids[t : t + 1].flip(-1), weights[t : t + 1].flip(-1), gate_up, down,
            bi.silu,
        )  # fmt: skip
        assert torch.equal(flipped, out[t : t + 1])
    # transformers marks a dropped slot with the expert count: it adds nothing
    dropped = ids.clone()
    dropped[:, -1] = experts
    got = bi.experts(x, dropped, weights, gate_up, down, bi.silu)
    partial = bi.experts(x, ids[:, :-1], weights[:, :-1], gate_up, down, bi.silu)
    assert torch.equal(got, partial)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, topk, every",
    [(1, 64, 32, 8, 4, True), (32, 64, 32, 8, 4, True), (45, 48, 24, 6, 2, True),
     (33, 32, 16, 16, 1, True), (5, 4, 4, 4, 2, False), (5, 8, 4, 4, 2, False),
     (5, 6, 8, 4, 2, False)],
)  # fmt: skip
def test_every_expert_on_every_token_gives_the_tiles_bits(
    monkeypatch, dtype, tokens, hidden, inter, experts, topk, every
):
    """``_every_expert`` (one product against all experts' weights) against each token
    through its own experts' tiles: the same bits, dropped slots included, and a token
    alone gets them too. Experts so small that their down product's tiles fall under
    torch's own bmm loop (``BMM_LOOP_MACS``) never take it (that bmm's bits would not
    be the tiles'), however little extra work it would be."""
    g = _gen(14)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    ids[::3, -1] = experts  # dropped
    weights = torch.rand(tokens, topk, generator=g)
    taken = []
    dense_fn = bi._every_expert
    monkeypatch.setattr(bi, "_every_expert", lambda *a: taken.append(1) or dense_fn(*a))
    monkeypatch.setattr(bi, "DENSE_EXTRA_MACS", 1 << 60)
    dense = bi.experts(x, ids, weights, gate_up, down, bi.silu)
    monkeypatch.setattr(bi, "DENSE_EXTRA_MACS", -1)
    tiled = bi.experts(x, ids, weights, gate_up, down, bi.silu)
    assert taken == ([1] if every else [])
    assert torch.equal(dense, tiled)
    for t in range(min(tokens, 5)):
        one = slice(t, t + 1)
        alone = bi.experts(x[one], ids[one], weights[one], gate_up, down, bi.silu)
        assert torch.equal(alone, tiled[one])


def test_every_expert_runs_for_a_small_models_decode_not_its_prefill(monkeypatch):
    """The tiny engine model's shape (64 wide, 8 experts of 32, top-4): a 32-row decode
    step takes ``_every_expert``, a 416-token prefill the tiles (~10M more products)."""
    taken = []
    every = bi._every_expert
    monkeypatch.setattr(bi, "_every_expert", lambda *a: taken.append(a[0].shape[0]) or every(*a))
    gate_up, down = torch.randn(8, 64, 64), torch.randn(8, 64, 32)
    for tokens in (32, 416):
        ids = torch.stack([torch.randperm(8)[:4] for _ in range(tokens)])
        bi.experts(torch.randn(tokens, 64), ids, torch.rand(tokens, 4), gate_up, down, bi.silu)
    assert taken == [32]


def test_the_mode_reroutes_model_code_and_refuses_what_it_cannot_hold():
    x = torch.randn(5, 64, generator=_gen(10))
    w = torch.randn(32, 64, generator=_gen(11))
    with bi.BatchInvariant():
        y = F.linear(x, w)
        s = torch.softmax(x, dim=-1, dtype=torch.float32)
        m = x.pow(2).mean(-1, keepdim=True)
        n = torch.tensor([[1, 2], [3, 4]]).sum(dim=(-1, -2))  # integers: as torch does
        act = F.silu(x)
        a = x @ w.T
        with pytest.raises(NotImplementedError, match="no rule for a matrix product"):
            torch.bmm(x[None], x[None].transpose(1, 2))
    assert torch.equal(y, bi.linear(x, w)) and torch.equal(a, y)
    assert torch.equal(s, bi.softmax(x, -1))
    assert torch.equal(m, bi.mean(x.pow(2), -1, keepdim=True))
    assert int(n) == 10
    assert torch.equal(act, bi.silu(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_transformers_formula_and_rerouted_from_torch(dtype):
    x = torch.randn(9, 3, 64, generator=_gen(12)).to(dtype)
    w = torch.rand(64, generator=_gen(13)).to(dtype)
    norm = torch.nn.RMSNorm(64, eps=1e-6, dtype=dtype)
    norm.weight.data.copy_(w)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = bi.rms_norm(x, w, 1e-6)
    _close(got, want, dtype)
    with torch.no_grad(), bi.BatchInvariant():
        assert torch.equal(norm(x), got)
    assert torch.equal(bi.rms_norm(x[4:5, 1:2], w, 1e-6), got[4:5, 1:2])


def test_tile_groups_start_every_group_on_a_tile():
    r = bi.ROWS
    sizes, dest = bi.tile_groups([3, 0, 2 * r + 1, r, 1])
    assert sizes == [r, 0, 3 * r, r, r]
    want = [*range(0, 3), *range(r, 3 * r + 1), *range(4 * r, 5 * r), 5 * r]
    assert dest.tolist() == want
    assert bi.tile_groups([])[1].numel() == 0


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("n,k", [(24, 32), (3, 32), (2, 8)])
def test_grouped_tiles_gathered_and_per_group_give_the_same_bits(monkeypatch, splits, n, k):
    """Also for tiles small enough that torch's CPU bmm multiplies them by a loop of its
    own (``BMM_LOOP_MACS``: [3, 16] and [2, 4] halves), whose bits are not mm's."""
    g = _gen(11)
    weights = torch.randn(5, n, k, generator=g)
    r = bi.ROWS
    sizes, dest = bi.tile_groups([3, 0, 2 * r + 1, r, 1])
    rows = torch.zeros(sum(sizes), k)
    rows[dest] = torch.randn(len(dest), k, generator=g)
    gathered = bi.grouped_tiles(rows, sizes, weights, splits)
    monkeypatch.setattr(bi, "GATHER_BYTES", 0)
    per_group = bi.grouped_tiles(rows, sizes, list(weights), splits)
    assert torch.equal(gathered, per_group)
    ref = torch.cat([rows[r * i : r * (i + 1)] @ weights[e].T
                     for i, e in enumerate([0, 2, 2, 2, 3, 4])])  # fmt: skip
    torch.testing.assert_close(gathered, ref)


def test_the_key_plan_follows_a_mask_changed_in_place():
    """The plan made for a mask is reused by the next layer's call with that mask, and
    remade once the mask is written in place (a decode buffer reused across steps)."""
    q, k, v = _attention_inputs(torch.float32, kv_heads=4, t=20)
    last, keep = q[:, :, -1:], torch.ones(1, 1, 1, 20, dtype=torch.bool)
    full = bi.attention(last, k, v, attn_mask=keep)
    keep[..., 5:9] = False  # the same tensor: keys 5..8 now unseen
    gapped = bi.attention(last, k, v, attn_mask=keep)
    fresh = bi.attention(last, k, v, attn_mask=keep.clone())
    assert torch.equal(gapped, fresh) and not torch.equal(gapped, full)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_masks_kept_for_a_forwards_layers_follow_its_key_plan(kv_heads):
    """The masks and the 'every query sees a key' shortcut that a forward's layers share
    are those of the plan at hand: a query that sees no key answers zeros (not 0/0) right
    after a same-shaped mask whose queries all saw keys, a mask written in place is read
    anew, and the second layer's call gives the first's bits."""
    q, k, v = _attention_inputs(torch.float32, kv_heads=kv_heads, t=20)
    last = q[:, :, -1:].expand(3, -1, -1, -1)
    k, v = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
    keep = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    seen = bi.attention(last, k, v, attn_mask=keep)
    assert torch.equal(seen, bi.attention(last, k, v, attn_mask=keep))  # the next layer
    none = keep.clone()
    none[1] = False  # another tensor, the same shape: row 1 sees nothing
    out = bi.attention(last, k, v, attn_mask=none)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], seen[0]) and torch.equal(out[2], seen[2])
    keep[2, ..., :7] = False  # in place: row 2 no longer sees keys 0..6
    fresh = bi.attention(last, k, v, attn_mask=keep.clone())
    assert torch.equal(bi.attention(last, k, v, attn_mask=keep), fresh)
    assert not torch.equal(fresh[2], seen[2]) and torch.equal(fresh[0], seen[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_heads_sharing_a_kv_head_get_the_bits_of_repeated_keys(dtype):
    """Grouped-query attention's tiles hold a kv head's query heads together: each
    query's bits are those it gets with the keys and values repeated per head."""
    q, k, v = _attention_inputs(dtype, kv_heads=2, t=21)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    assert torch.equal(
        bi.attention(q, k, v, is_causal=True), bi.attention(q, kr, vr, is_causal=True)
    )
    keep = torch.ones(1, 1, 1, 21, dtype=torch.bool)
    keep[..., 2:5] = False
    last = q[:, :, -1:]
    assert torch.equal(bi.attention(last, k, v, attn_mask=keep),
                       bi.attention(last, kr, vr, attn_mask=keep))  # fmt: skip


@pytest.mark.parametrize("k", [64, 2048])
def test_row_sums_give_a_row_the_same_bits_in_any_batch(k):
    """RMSNorm's sum of squares: one fixed-shape product with ones, a row's bits the same
    alone, in a short batch or at any position of a long one (a single-column product is
    not: its rows' bits move with their position)."""
    x = torch.randn(40, k, generator=_gen(12))
    whole = bi.row_sums(x)
    torch.testing.assert_close(whole[:, 0], x.double().sum(-1).float(), rtol=1e-5, atol=1e-4)
    # linear's tile product with ones, its first column (row_sums skips linear's generality)
    assert torch.equal(whole, bi.linear(x, torch.ones(k, bi.ROWS).t())[..., :1])
    assert torch.equal(bi.row_sums(x.view(8, 5, k)), whole.view(8, 5, 1))
    for start in (0, 5, 23):
        for n in (1, 3, 17):
            assert torch.equal(bi.row_sums(x[start : start + n]), whole[start : start + n])


def _tile_by_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, factor: float):
    """Causal attention of one head [Q, D] written tile by tile: each [ATTENTION_ROWS
    queries] × [ATTENTION_KEYS keys] score block its own product, each block's values
    its own product, the blocks' value sums folded over key tiles in order."""
    rows, keys = bi.ATTENTION_ROWS, bi.ATTENTION_KEYS
    q_len, t = q.shape[0], k.shape[0]
    qp = torch.cat([q, q.new_zeros(-q_len % rows, q.shape[1])])
    kp = torch.cat([k, k.new_zeros(-t % keys, k.shape[1])])
    vp = torch.cat([v, v.new_zeros(-t % keys, v.shape[1])])
    scores = torch.cat(
        [torch.cat([qp[i : i + rows] @ kp[j : j + keys].T for j in range(0, len(kp), keys)], 1)
         for i in range(0, len(qp), rows)]
    )[:q_len] * factor  # fmt: skip
    seen = torch.arange(1, q_len + 1)[:, None] + (t - q_len)
    scores = scores.masked_fill(torch.arange(len(kp)) >= seen, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    total = p.cumsum(-1)[:, -1:]
    p = torch.cat([p, p.new_zeros(-q_len % rows, len(kp))])
    out = []
    for i in range(0, len(qp), rows):
        parts = [p[i : i + rows, j : j + keys] @ vp[j : j + keys] for j in range(0, len(kp), keys)]
        out.append(torch.stack(parts).cumsum(0)[-1])
    return torch.cat(out)[:q_len] / total


@pytest.mark.parametrize("q_len,t", [(1, 1), (1, 37), (7, 7), (40, 40), (3, 50)])
def test_whole_row_products_give_each_tile_the_bits_of_its_own_product(q_len, t):
    """The tiled attention multiplies a row's queries by all its keys at once, and by
    each key tile's values at once (kernels/batch_invariant.py says why that keeps each
    tile's bits on the CPU): the same bits as one product per tile, written out here."""
    gen = _gen(3)
    q = torch.randn(1, 2, q_len, 24, generator=gen)
    k, v = torch.randn(1, 2, t, 24, generator=gen), torch.randn(1, 2, t, 16, generator=gen)
    factor = 1 / math.sqrt(24)
    mask = torch.ones(q_len, t, dtype=torch.bool).tril(t - q_len)
    got = bi.attention(q, k, v, attn_mask=mask[None, None], scale=factor)
    for head in range(2):
        ref = _tile_by_tile(q[0, head], k[0, head], v[0, head], factor)
        assert torch.equal(got[0, head], ref), (head, (got[0, head] - ref).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k,n,m", [(64, 1, 16), (64, 2, 5), (96, 48, 33), (256, 151, 64), (32, 4096, 17)]
)
def test_linear_gives_each_tile_the_bits_of_its_own_product(dtype, k, n, m):
    """``linear`` multiplies all of a shared weight's tiles in one product where that
    keeps their bits (kernels/batch_invariant.py ``_tiles``): the same bits as one
    [ROWS, K] × [K, N] product per tile, written out here, split along K or not (one
    output column: the first of a product with two, the second zero)."""
    gen = _gen(4)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    rows = torch.cat([x, x.new_zeros(-m % bi.ROWS, k)])
    tile_w = w if n > 1 else torch.cat([w, w.new_zeros(1, k)])
    for splits in (1, 2):
        step = k // splits
        parts = [
            torch.cat([rows[i : i + bi.ROWS, c : c + step] @ tile_w[:, c : c + step].T
                       for i in range(0, len(rows), bi.ROWS)])
            for c in range(0, k, step)
        ]  # fmt: skip
        ref = parts[0] if splits == 1 else parts[0] + parts[1]
        assert torch.equal(bi.linear(x, w, splits=splits), ref[:m, :n]), splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [16, 32, 64, 512])
def test_a_one_column_linear_gives_a_row_the_same_bits_beside_any_rows(dtype, k):
    """A weight with a single output row (a value head, a gate's score) gives a row the
    bits it gets alone however many rows share the call, split along K or not. A batch
    of one-column tile products with one shared weight ran as one matrix-vector product
    in torch, and a row's bits changed with the number of tiles (fp32, K ≥ 32)."""
    gen = _gen(9)
    x = torch.randn(80, k, generator=gen).to(dtype)
    w = torch.randn(1, k, generator=gen).to(dtype)
    for splits in (1, 2):
        alone = bi.linear(x[:3], w, splits=splits)
        for rows in (16, 40, 80):
            assert torch.equal(bi.linear(x[:rows], w, splits=splits)[:3], alone), (rows, splits)
