"""Batch-invariant ops: a row's result depends on that row's inputs alone, never on the
rows beside it, their number, the padding or where the row sits in the batch.

torch's own CPU ops are not: one [M, K] × [K, N] product gives other bits for M=1 (a
GEMV) than for M>1 (blocked GEMMs whose blocking follows M); a reduction kernel splits a
long axis across threads when there are few outputs; and ``sigmoid`` / ``silu`` (fp32),
``rsqrt`` (bf16) take a vector path or a scalar one by the element's position in the
buffer. The ops here follow these rules instead, each checked by
``tests/unit/test_batch_invariant.py``:

- A reduction over an axis of fixed length (hidden size, head dim, vocabulary, experts)
  is a pairwise tree of elementwise adds over that axis padded to a power of two
  (``tree_sum``): no reduction kernel runs, so nothing splits with size or threads.
- A matrix product runs as a batch of [ROWS, K] × [K, N] products of one fixed shape
  (``linear``): every row meets the same kernel, and its result does not depend on
  where in the tile it sits.
- Attention drops the keys no query of a row sees (left padding, the gap between a
  shared prompt and a row's own tokens), so a key's index is its position in the
  sequence in a prefill, a decode step or a prefix read; scores and the values' sum are
  then fixed-shape tile products (``ATTENTION_ROWS`` queries × ``ATTENTION_KEYS`` keys),
  the values' partial sums folded over key tiles in order. A masked or missing key adds
  an exact zero wherever it sits. Sums over keys whose number changes with the batch
  (the softmax's total) are a left fold in key order (``fold_sum``: cumsum's last
  element).

Elementwise ops that are exact (add, mul, div) or position-independent here (exp, log,
sqrt, cos, sin; fp32 rsqrt) are used as they are; sigmoid and silu are built from exp.
``BatchInvariant`` is a ``TorchFunctionMode`` that reroutes the model code's calls
(``F.linear``, softmax, mean, sdpa, ...) to these ops inside its ``with`` block, and
refuses a matrix product it has no rule for rather than let it through.

These rules were measured on the CPU (MKL). On CUDA torch's products do not keep them:
on an H200, in fp32, a batch of 16 or more fixed-shape tiles gave a row other bits than
a shorter batch (``tools/gpu/probe_invariance.py`` checks each op on a device). Every
product here therefore goes through ``tile_product``: torch's own on the CPU, on CUDA
one Triton kernel of one fixed configuration whose element sums do not depend on the
batch or the shapes (checked in Triton's interpreter; not yet run on a GPU).
"""

# B batch, h heads, Q query tokens, T key tokens, D head dim, E experts, K top-k

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moerl.kernels import tile_product

ROWS = 8
"""Rows of each fixed-shape product in ``linear`` and of each expert's tiles in
``experts``. On the CPU a row's bits are the same in a product of any multiple of 4
rows (measured for K 16-4096, N 2-8192, 4-256 rows, fp32 and bf16, 1, 2, 4 and 8
threads), not in one of 1-3 rows; 8 rather than 16 halves a decode step's padding of
each expert's few tokens (the mid shape's experts: 71-77 → 40 ms over off in a
session). 4 would add batched products small enough for torch's own loop
(``BMM_LOOP_MACS``) without saving much more."""

BMM_LOOP_MACS = 400
"""torch's CPU ``bmm`` multiplies matrices of fewer multiply-adds than this by a loop of
its own, not by the BLAS kernel ``mm`` runs, so such a batched product's bits differ
from ``mm``'s (measured: exactly the [ROWS, K] × [K, N] tiles with ROWS·K·N < 400
differ); ``grouped_tiles`` does not gather weights into one batched product for those,
nor does ``experts`` take ``_every_expert`` (``_bmm_is_blas``)."""


def _bmm_is_blas(k: int, n: int) -> bool:
    """Whether torch's CPU ``bmm`` of [ROWS, k] × [k, n] tiles runs the BLAS kernel, and
    so gives each tile ``mm``'s bits (``BMM_LOOP_MACS``)."""
    return ROWS * k * n >= BMM_LOOP_MACS


K_SPLITS = 2
"""Chunks of the inner dimension that a row-parallel weight's product sums (attention's
output projection, the MLPs' and experts' down projections: the weights tensor
parallelism splits along that dimension), added pairwise in order. A layout splitting
it over up to K_SPLITS tensor-parallel ranks computes the same chunks and adds the
ranks' sums the same way (two ranks: a + b, in either order)."""

ATTENTION_CHUNK_ELEMENTS = 1 << 24
"""Elements of one [B, h, Q, T, D] product block in ``attention`` (queries are chunked)."""

_HALF = (torch.float16, torch.bfloat16)

_F = TypeVar("_F", bound=Callable[..., Any])


def _plain(fn: _F) -> _F:
    """``fn``'s own torch calls run as they are, also inside ``BatchInvariant`` (the
    ops here are the definitions, not calls to reroute)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 → fp32 (sums accumulate in fp32, as torch's reductions do)."""
    return x.float() if x.dtype in _HALF else x


@_plain
def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` by a pairwise tree of elementwise adds (zero-padded to a power of
    two); fp16/bf16 sum in fp32 and return fp32."""
    x = _wide(x).movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    if n == 0:
        x = x.new_zeros(*x.shape[:-1], 1)
    out = x.movedim(-1, dim) if keepdim else x.squeeze(-1)
    return out


@_plain
def fold_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as a left fold in index order (a cumulative sum's last element):
    exact zeros anywhere along ``dim`` leave the result's bits unchanged."""
    x = _wide(x)
    return x.cumsum(dim).select(dim, -1)


@_plain
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, splits: int = 1
) -> torch.Tensor:
    """``F.linear`` as a batch of fixed-shape [ROWS, K] × [K, N] products; with ``splits``
    (``K_SPLITS`` for a row-parallel weight), the sum of that many K-chunks' products,
    added pairwise in order."""
    rows, m = _whole_tiles(x)
    product = _tiles(rows, weight) if splits == 1 else _split_tiles(rows, weight, splits)
    out = product[:m].view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _whole_tiles(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x's rows [M, K] zero-padded to whole ROWS tiles, at least one; M)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    pad = (-m) % ROWS
    if pad or m == 0:
        rows = torch.cat([rows, rows.new_zeros(pad or ROWS, k)])
    return rows, m


def _split_tiles(rows: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    return split_k(_tiles, rows, weight, splits)


def split_k(
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: int,
) -> torch.Tensor:
    """``product(x, weight)`` [.., N] as the ``pairwise`` sum of ``splits`` products over
    equal chunks of K (x's last axis, the last axis of weight [.., N, K])."""
    if splits == 1:
        return product(x, weight)
    k = x.shape[-1]
    if k % splits:
        raise ValueError(f"batch-invariant linear: K={k} does not split into {splits} chunks")
    step = k // splits
    return pairwise(
        [product(x[..., i : i + step], weight[..., i : i + step]) for i in range(0, k, step)]
    )


def pairwise(parts: list[torch.Tensor]) -> torch.Tensor:
    """Σ parts as a balanced pairwise tree in order (zero-padded to a power of two)."""
    while len(parts) > 1:
        if len(parts) % 2:
            parts = [*parts, torch.zeros_like(parts[0])]
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


@_plain
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` where every row of ``a`` meets the same kernel: a 2-D ``b`` is a
    ``linear``; a product over one element (an outer product) is exact as it is."""
    if a.shape[-1] == 1 and b.dim() >= 2 and b.shape[-2] == 1:
        return torch.matmul(a, b)
    if b.dim() == 2 and a.dim() >= 2:
        return linear(a, b.t())
    raise NotImplementedError(
        f"batch-invariant mode: no rule for a matrix product of {tuple(a.shape)} and "
        f"{tuple(b.shape)}; add one in kernels/batch_invariant.py"
    )


def _dim(dim: Any, ndim: int) -> int | None:
    """One reduction axis, or None for 'all of them' (a list of several is refused)."""
    if dim is None:
        return None
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            raise NotImplementedError(f"batch-invariant mode: a sum over dims {dim}")
        dim = dim[0]
    return int(dim) % max(ndim, 1)


def _total(x: torch.Tensor, dim: Any, keepdim: bool) -> tuple[torch.Tensor, int]:
    """(``tree_sum`` over ``dim`` or over everything, the number of terms summed)."""
    axis = _dim(dim, x.dim())
    if axis is None:
        return tree_sum(x.reshape(-1)), x.numel()
    return tree_sum(x, axis, keepdim), x.shape[axis]


@_plain
def sum_(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    """``torch.sum`` of a floating tensor by ``tree_sum``."""
    return _total(x, dim, keepdim)[0].to(dtype or x.dtype)


@_plain
def mean(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> torch.Tensor:
    """``torch.mean`` by ``tree_sum`` divided by the count."""
    out, count = _total(x, dim, keepdim)
    return (out / count).to(dtype or x.dtype)


def _finite_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The max over ``dim`` (kept; a max is exact), 0 for a row of all −inf."""
    top = x.amax(dim, keepdim=True)
    return top.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # every non-finite max → 0


def _shifted(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x − max over ``dim``; a row of all −inf is shifted by 0."""
    return x - _finite_max(x, dim)


@_plain
def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x.to(dtype) if dtype is not None else x
    e = torch.exp(_shifted(_wide(x), dim))
    return (e / tree_sum(e, dim, keepdim=True)).to(x.dtype)


@_plain
def log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x − (max + log Σ exp(x − max)): the trainer's logprob formula
    (kernels/logprob_torch.py), so the engine's and the trainer's logprobs can agree."""
    x = x.to(dtype) if dtype is not None else x
    w = _wide(x)
    return (w - _log_z(w, dim)).to(x.dtype)


def _log_z(w: torch.Tensor, dim: int) -> torch.Tensor:
    """max + log Σ exp(w − max) over ``dim`` (kept); a row of all −inf is shifted by 0."""
    top = _finite_max(w, dim)
    return top + torch.log(tree_sum(torch.exp(w - top), dim, keepdim=True))


@_plain
def logsumexp(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    out = _log_z(_wide(x), dim)
    return (out if keepdim else out.squeeze(dim)).to(x.dtype)


@_plain
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(−x)), computed in fp32 for fp16/bf16."""
    return _sigmoid(_wide(x)).to(x.dtype)


def _sigmoid(w: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(−w)) of an fp32 (or fp64) tensor; without autograd in one buffer,
    each op in place (the same ops, the same bits, no temporaries)."""
    if torch.is_grad_enabled() and w.requires_grad:
        return 1.0 / (1.0 + torch.exp(-w))
    out = torch.neg(w)
    return torch.reciprocal(out.exp_().add_(1.0), out=out)


@_plain
def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    w = _wide(x)
    return (w * _sigmoid(w)).to(x.dtype)


@_plain
def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``rsqrt`` (position-independent), also for fp16/bf16 inputs."""
    return torch.rsqrt(_wide(x)).to(x.dtype)


@_plain
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """RMSNorm over the last axis as transformers' models write it: statistics in fp32
    (the mean of squares, its sum by ``row_sums``), the normed value cast back, then
    times ``weight``."""
    h = x.float()
    h = (h * torch.rsqrt(row_sums(h * h) / h.shape[-1] + eps)).to(x.dtype)
    return h if weight is None else weight * h


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last axis [.., 1] of an fp32 tensor as one fixed-shape tile product
    with ones ([ROWS, K] × [K, ROWS], first column): one kernel call instead of a tree's
    log₂ K adds, for the short axes (hidden sizes) it serves. ``linear``'s product of
    whole tiles, without its bias and splits: every norm of a step calls it."""
    rows, m = _whole_tiles(x)
    ones = _ones(x.shape[-1], x.dtype, x.device)
    return _tiles(rows, ones.t())[:m, :1].view(*x.shape[:-1], 1)


_ONES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _ones(k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [K, ROWS] matrix of ones (``row_sums``'s right factor), made once per shape."""
    key = (k, dtype, device)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones(k, ROWS, dtype=dtype, device=device)
    return ones


@_plain
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` [B, h, Q, D] where a query's result depends on
    its keys alone.

    The keys no query of a batch row sees (left padding, the gap between a shared prompt
    and a row's own tokens) are dropped first, keeping the others in order; when every
    query then sees a prefix of the remaining keys (causal rows, decode, prefix reuse),
    a key's index is its position in the sequence wherever the row came from, and
    ``_tiled_attention`` computes scores and values as fixed-shape tile products (the
    query heads sharing a key/value head share its tiles). Other masks (packed rows'
    block diagonals) take ``_folded_attention``: elementwise products, ``tree_sum`` over
    D and ``fold_sum`` over keys."""
    if dropout_p:
        raise NotImplementedError("batch-invariant mode: attention dropout")
    heads, kv_heads = query.shape[-3], key.shape[-3]
    q_len, k_len = query.shape[-2], key.shape[-2]
    additive = None
    keep = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask
    elif attn_mask is not None:
        additive = attn_mask
    # causal queries alone take their counts (query i sees keys 0..i); the mask only with
    # another mask or outside the tiles
    counts_only = is_causal and attn_mask is None and query.dim() == 4
    if is_causal and not counts_only:
        tril = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
        keep = tril if keep is None else tril & keep
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q, k, v = _wide(query), _wide(key), _wide(value)
    if q.dim() == 4 and additive is None:
        b = q.shape[0]
        if counts_only:
            plan: tuple[torch.Tensor | None, torch.Tensor | int] | None = (
                None,
                _causal_counts(q_len, k_len, q.device),
            )
        else:
            plan = _cached_plan(attn_mask, keep, b, heads, q_len, k_len)
        if plan is not None:
            index, seen = plan
            group = heads // kv_heads
            if group > 1:  # a kv head's query heads as one set of rows: (head, query)
                q = q.reshape(b, kv_heads, group * q_len, -1)
                if isinstance(seen, torch.Tensor):
                    seen = _grouped_counts(seen, b, heads, kv_heads, q_len)
            out = _tiled_attention(q, k, v, index, seen, factor)
            return out.reshape(b, heads, q_len, -1).to(query.dtype)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
        v = v.repeat_interleave(heads // kv_heads, dim=-3)
    return _folded_attention(q, k, v, keep, additive, factor).to(query.dtype)


_MEMO = threading.local()
"""Per thread (the colocated engine's scheduler and the trainer share a process): the
last (mask, shape, plan) ``_cached_plan`` made (a model's layers share one mask), the
last counts tensor ``_hidden_keys`` saw and its masks, and ``_grouped_counts``' last."""


@functools.lru_cache(maxsize=4)
def _causal_counts(q_len: int, k_len: int, device: Any) -> torch.Tensor:
    """The keys each causal query sees [Q] (query i: keys 0..i), one tensor per shape, so
    a forward's layers share ``_hidden_keys``' masks."""
    return torch.arange(1, q_len + 1, device=device).clamp(max=k_len)


def _grouped_counts(
    seen: torch.Tensor, b: int, heads: int, kv_heads: int, q_len: int
) -> torch.Tensor:
    """Counts [B, h, Q] as the rows of each kv head's query heads [B, kv_heads, group·Q],
    made once per counts tensor (a forward's layers share it, and so the masks)."""
    key = (b, heads, kv_heads, q_len, seen._version)
    kept = getattr(_MEMO, "grouped", None)
    if kept is not None and kept[0]() is seen and kept[1] == key:
        return kept[2]  # type: ignore[no-any-return]
    grouped = seen.expand(b, heads, q_len).reshape(b, kv_heads, heads // kv_heads * q_len)
    _MEMO.grouped = (weakref.ref(seen), key, grouped)
    return grouped


ATTENTION_ROWS = 4
"""Queries per tile in ``_tiled_attention``: fewer than ROWS, since a decode step fills
one of a tile's rows."""

ATTENTION_KEYS = 16
"""Keys per tile in ``_tiled_attention``."""


def _cached_plan(
    mask: torch.Tensor | None, keep: torch.Tensor | None, b: int, h: int, q_len: int, k_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | int] | None:
    """``_key_plan``, made once for the mask every layer of a forward passes, its
    index as ``_flat_index`` (what ``_tiled_attention`` reads)."""
    # the same tensor, unchanged since (its version counter counts in-place writes)
    shape = (b, h, q_len, k_len, keep is mask, None if mask is None else mask._version)
    kept = getattr(_MEMO, "plan", None)
    if mask is not None and kept is not None and kept[0]() is mask and kept[1] == shape:
        return kept[2]  # type: ignore[no-any-return]
    plan = _key_plan(keep, b, h, q_len, k_len)
    if plan is not None and plan[0] is not None:
        plan = (_flat_index(plan[0], k_len), plan[1])
    if mask is not None:
        _MEMO.plan = (weakref.ref(mask), shape, plan)
    return plan


def _key_plan(
    keep: torch.Tensor | None, b: int, h: int, q_len: int, k_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | int] | None:
    """How ``_tiled_attention`` reads the keys: (each row's seen keys in order, as their
    positions [B, most seen] with −1 for none, or None when every key is seen; the keys each
    query sees [B, h, Q], the first that many of its row's); None where some query sees
    other than a prefix of its row's seen keys (a block-diagonal mask)."""
    if keep is None:
        return None, k_len
    keep = keep.expand(b, h, q_len, k_len)
    seen_BT = keep.any(dim=2).any(dim=1)
    counts = keep.sum(-1)  # [B, h, Q]
    rank_BT = seen_BT.cumsum(-1) - 1
    prefix = seen_BT[:, None, None] & (rank_BT[:, None, None] < counts[..., None])
    if not torch.equal(keep, prefix):
        return None
    seen = seen_BT.sum(-1, keepdim=True)  # [B, 1]
    if torch.equal(seen_BT, torch.arange(k_len, device=keep.device) < seen):
        return None, counts  # every row's seen keys are already its first ones
    order = (~seen_BT).to(torch.int8).argsort(dim=-1, stable=True)  # seen keys first
    width = int(seen.max())
    slots = torch.arange(width, device=keep.device)
    return torch.where(slots < seen, order[:, :width], -1), counts


def _key_rows(x: torch.Tensor, index: torch.Tensor | None, length: int) -> torch.Tensor:
    """Keys or values [B, h, T, D] as [B, h, length, D]: a row's seen keys in order, then
    zeros (``index``: ``_flat_index``'s [B·length] rows; all keys when None)."""
    b, h, k_len, d = x.shape
    if index is None:
        pad = length - k_len
        return torch.cat([x, x.new_zeros(b, h, pad, d)], dim=-2) if pad else x
    rows = x.new_empty(b * k_len + 1, h * d)  # [B·T tokens, h·D], then a zero row
    rows[:-1].view(b, k_len, h, d).copy_(x.transpose(1, 2))
    rows[-1].zero_()
    picked = rows.index_select(0, index)
    return picked.view(b, length, h, d).transpose(1, 2).contiguous()


def _flat_index(index: torch.Tensor, k_len: int) -> torch.Tensor:
    """``_key_plan``'s index [B, n] (positions, −1 for none) as rows of the [B·T + 1]
    token rows ``_key_rows`` lays out, each batch row padded with the zero row (B·T) to
    whole ATTENTION_KEYS tiles: [B·length]."""
    b, width = index.shape
    length = -(-max(width, 1) // ATTENTION_KEYS) * ATTENTION_KEYS
    zero = b * k_len
    base = torch.arange(b, device=index.device)[:, None] * k_len
    flat = torch.where(index >= 0, index + base, zero)
    return F.pad(flat, (0, length - width), value=zero).reshape(-1)


def _tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor | None,
    counts: torch.Tensor | int,
    factor: float,
) -> torch.Tensor:
    """Attention over a row's seen keys, in order (``_key_plan``, its index as
    ``_flat_index``'s rows, or None for all keys): a key's index is its
    position in the sequence. Scores are [ATTENTION_ROWS queries] × [ATTENTION_KEYS keys]
    tile products over D; the values' weighted sum is one [ATTENTION_ROWS,
    ATTENTION_KEYS] × [ATTENTION_KEYS, Dv] product per tile pair, folded over key tiles
    in order; the softmax's total is ``fold_sum`` over keys. A key a query does not see,
    and the padding, weigh exact zeros wherever they sit.

    The tile products run as whole-row products: all of a (batch row, head)'s queries,
    padded to a multiple of ATTENTION_ROWS, against all its keys (padded to whole
    tiles) in one product, and against each key tile's values in one product per tile.
    On the CPU such a product gives every [ATTENTION_ROWS, ATTENTION_KEYS] block the
    bits of that block's own tile product, whatever the number of query and key tiles
    (measured, and checked by tests/unit/test_batch_invariant.py against the tile
    products); it saves the tiles' copies. Values that are a strided view (the engine's
    KV pool read in place, up to whole key tiles) multiply one key tile at a time,
    over views, rather than being copied into one batch of tiles."""
    b, h, q_len, d = q.shape
    width = k.shape[-2] if index is None else index.numel() // b
    k_pad = -(-max(width, 1) // ATTENTION_KEYS) * ATTENTION_KEYS
    tiles = k_pad // ATTENTION_KEYS
    keys_t = _key_rows(k, index, k_pad).reshape(b * h, k_pad, d).transpose(1, 2)
    v_rows = _key_rows(v, index, k_pad)
    dv = v_rows.shape[-1]
    # the values as one batch of key tiles where that is a view; else (a strided view
    # of the engine's KV pool, read up to whole tiles) each key tile's product alone,
    # over [B·h, keys, Dv] views: the same products, without copying the values
    v_bh = v_rows.reshape(b * h, k_pad, dv)
    v_tiles = v_bh.view(b * h * tiles, ATTENTION_KEYS, dv) if v_bh.is_contiguous() else None
    rows = ATTENTION_ROWS
    per_query = max(1, k_pad * (d + dv) * b * h)
    step = max(1, ATTENTION_CHUNK_ELEMENTS // per_query // rows) * rows
    outs = []
    for first in range(0, q_len, step):
        n = min(first + step, q_len) - first
        n_pad = -(-n // rows) * rows
        q_part = q[..., first : first + n, :]
        if n_pad != n:
            q_part = F.pad(q_part, (0, 0, 0, n_pad - n))
        # the padding queries' rows ride along to the values' product (a row of a
        # product does not depend on the rows beside it): they see every key, so they
        # stay finite
        hide, every = _hidden_keys(counts, first, n, n_pad, k_pad, q.device)
        scores = tile_product.bmm(q_part.reshape(b * h, n_pad, d), keys_t)  # [B·h, n_pad, T]
        scores = scores.view(b, h, n_pad, k_pad) * factor
        scores.masked_fill_(hide, -math.inf)
        p = torch.exp(
            scores - (scores.amax(-1, keepdim=True) if every else _finite_max(scores, -1))
        )
        real = p[..., :n, :] if n_pad != n else p
        total = fold_sum(real, -1)[..., None]
        # one [n_pad, keys] block per key tile: [B·h·Tt, n_pad, keys]
        p_tiles = p.view(b, h, n_pad, tiles, ATTENTION_KEYS).transpose(2, 3)
        p_tiles = p_tiles.reshape(b * h * tiles, n_pad, ATTENTION_KEYS)
        if v_tiles is not None:
            parts = tile_product.bmm(p_tiles, v_tiles)
        else:
            p_bh = p_tiles.view(b * h, tiles, n_pad, ATTENTION_KEYS)
            keys = [slice(j * ATTENTION_KEYS, (j + 1) * ATTENTION_KEYS) for j in range(tiles)]
            parts = torch.stack(
                [tile_product.bmm(p_bh[:, j], v_bh[:, key]) for j, key in enumerate(keys)], 1
            )
        weighted = fold_sum(parts.view(b, h, tiles, n_pad, dv)[..., :n, :], 2)
        outs.append(weighted / total if every else torch.where(total > 0, weighted / total, 0.0))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


MEMO_MASK_ELEMENTS = 1 << 20
"""``_hidden_keys`` keeps masks of at most this many elements (a decode step's, a short
prefill's); longer sequences' masks are made per call, as they are cheap beside their
attention and large to hold."""


def _hidden_keys(
    counts: torch.Tensor | int, first: int, n: int, n_pad: int, k_pad: int, device: Any
) -> tuple[torch.Tensor, bool]:
    """(the keys queries first..first+n of a chunk do not see, [.., n_pad, k_pad] with the
    ``n_pad - n`` padding queries seeing every key; whether every query sees one). Kept
    for the last counts tensor while it is unchanged: a forward's layers share it."""
    if isinstance(counts, int):
        return _hidden_prefix(counts, k_pad, device), counts > 0
    shape = (first, n, n_pad, k_pad, counts._version)
    kept: tuple[Any, dict[tuple[int, ...], tuple[torch.Tensor, bool]]] | None
    kept = getattr(_MEMO, "hidden", None)
    if kept is None or kept[0]() is not counts:
        kept = (weakref.ref(counts), {})
        _MEMO.hidden = kept
    made = kept[1].get(shape)
    if made is None:
        seen = counts[..., first : first + n]
        every = bool((seen > 0).all())
        if n_pad != n:
            seen = F.pad(seen, (0, n_pad - n), value=k_pad)
        made = (torch.arange(k_pad, device=seen.device) >= seen[..., None], every)
        if made[0].numel() <= MEMO_MASK_ELEMENTS:
            kept[1][shape] = made
    return made


@functools.lru_cache(maxsize=64)
def _hidden_prefix(seen: int, k_pad: int, device: Any) -> torch.Tensor:
    """[k_pad]: the keys past the first ``seen`` (every query sees those)."""
    return torch.arange(k_pad, device=device) >= seen


def _folded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    additive: torch.Tensor | None,
    factor: float,
) -> torch.Tensor:
    """Scores by ``tree_sum`` over D, the softmax's sum and the values' weighted sum by
    ``fold_sum`` over keys (masked keys add exact zeros), for any mask."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    per_query = max(1, math.prod(k.shape[:-2]) * k_len * max(k.shape[-1], v.shape[-1]))
    step = max(1, ATTENTION_CHUNK_ELEMENTS // per_query)
    outs = []
    for first in range(0, q_len, step):
        rows = slice(first, min(first + step, q_len))
        scores = tree_sum(q[..., rows, None, :] * k[..., None, :, :], -1) * factor  # [B,h,q,T]
        if additive is not None:
            scores = scores + _wide(additive[..., rows, :])
        if keep is not None:
            scores = scores.masked_fill(~keep[..., rows, :], -math.inf)
        p = torch.exp(_shifted(scores, -1))
        total = fold_sum(p, -1)[..., None]
        weighted = fold_sum(p[..., None] * v[..., None, :, :], -2)  # [B,h,q,Dv]
        outs.append(torch.where(total > 0, weighted / total, torch.zeros_like(weighted)))
    return torch.cat(outs, dim=-2)


@_plain
def experts(
    hidden_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Routed experts (gate and up concatenated, transformers' fused layout). Each
    expert's tokens, padded to whole [ROWS, H] tiles, go through ``_tiles`` (one product
    per expert and projection); a token's outputs, scaled by its weights, are summed in
    ascending expert id (a fixed order, not the order tokens reach an expert), in fp32 for
    fp16/bf16. An id of E (transformers' mark for a dropped slot) adds nothing. Few
    tokens of a small model (``DENSE_EXTRA_MACS``) run every expert on every token
    instead (``_every_expert``: the same bits, fewer and larger products)."""
    tokens, topk = ids_TK.shape
    num = gate_up_E2IH.shape[0]
    device = hidden_TH.device
    # every expert on every token, where that is at most DENSE_EXTRA_MACS more work than
    # the tiles of each token's own experts (of which there are at least tokens·topk rows)
    every_rows = num * -(-max(tokens, 1) // ROWS) * ROWS
    macs = gate_up_E2IH.shape[1] * gate_up_E2IH.shape[2] + down_EHI.shape[1] * down_EHI.shape[2]
    # (its down product is a bmm: only where that gives mm's bits)
    blas = _bmm_is_blas(down_EHI.shape[2] // K_SPLITS, down_EHI.shape[1])
    if blas and (every_rows - tokens * topk) * macs <= DENSE_EXTRA_MACS:
        sorted_ids, by_id_t = ids_TK.sort(dim=-1, stable=True)
        slots_TKH = _every_expert(
            hidden_TH, (gate_up_E2IH, down_EHI), act, sorted_ids, weights_TK.gather(1, by_id_t)
        )
        return _sum_slots(slots_TKH, hidden_TH.dtype)
    # the bookkeeping on the host, in numpy (a few small index arrays; the counts are
    # needed there anyway): torch's small ops cost more in dispatch than in work
    ids = ids_TK.cpu().numpy()
    by_id = np.argsort(ids, axis=-1, kind="stable")
    flat = np.take_along_axis(ids, by_id, -1).reshape(-1)  # slot = token·topk + rank by id
    counts = np.bincount(flat, minlength=num + 1)[:num]
    order = np.argsort(flat, kind="stable")[: int(counts.sum())]  # by expert, then token
    sizes, dest = tile_groups(counts.tolist(), device)
    weights_S1 = weights_TK.gather(1, torch.as_tensor(by_id, device=device)).reshape(-1, 1)
    order_t = torch.as_tensor(order, device=device)
    x = hidden_TH.new_zeros(sum(sizes), hidden_TH.shape[-1])
    x[dest] = hidden_TH[torch.as_tensor(order // topk, device=device)]
    gate, up = grouped_tiles(x, sizes, gate_up_E2IH).chunk(2, dim=-1)
    h = act(gate) * up
    y = grouped_tiles(h, sizes, down_EHI, K_SPLITS)
    out = hidden_TH.new_zeros(tokens * topk, hidden_TH.shape[-1])
    out[order_t] = (y[dest] * weights_S1[order_t]).to(out.dtype)
    return _sum_slots(out.view(tokens, topk, -1), hidden_TH.dtype)


def _sum_slots(slots_TKH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A token's expert outputs [T, K, H] (in ascending expert id) summed in that order,
    in fp32 for fp16/bf16 and rounded once, as torch's scatter_add (megatron-core's
    unpermute) accumulates a row's contributions."""
    total = _wide(slots_TKH[:, 0])
    for k in range(1, slots_TKH.shape[1]):
        total = total + _wide(slots_TKH[:, k])
    return total.to(dtype)


DENSE_EXTRA_MACS = 1 << 22
"""``experts`` runs every expert on every token when that costs at most this many more
multiply-adds than the tiles of each token's own experts (``_every_expert``): on a small
model's decode step the number of products, not their size, sets the time (the tiny
model's 32-token step: 182 → 125 µs a layer in fp32, 268 → 174 in bf16; its 416-token
prefill, ~10M more, 1.2× slower; the mid shape's decode, 100M more, 1.4× slower)."""


def _every_expert(
    hidden_TH: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Each token's scaled expert outputs [T, K, H] as ``experts`` makes them (``ids_TK``
    ascending per token, ``weights_TK`` in that order; ``weights``: gate/up [E, 2I, H] and
    down [E, H, I]), with every expert applied to every token: the gate/up product as one
    fixed-shape tile product against all experts' weights side by side, the down product
    one batch entry per expert, then each token's own experts' outputs picked. A token's
    row meets the same tile product as in its own experts' tiles (a row's bits do not
    depend on the rows or the other weights' columns beside it:
    tests/unit/test_batch_invariant.py), so the bits are ``experts``' own."""
    gate_up_E2IH, down_EHI = weights
    tokens = ids_TK.shape[0]
    num, width, hidden = gate_up_E2IH.shape
    rows, _ = _whole_tiles(hidden_TH)  # [Tp, H]
    gate, up = (
        _tiles(rows, gate_up_E2IH.reshape(num * width, hidden)).view(-1, num, width).chunk(2, -1)
    )
    h_ETI = (act(gate) * up).transpose(0, 1).contiguous()  # [E, Tp, I]
    y_ETH = split_k(lambda x, w: tile_product.bmm(x, w.transpose(1, 2)), h_ETI, down_EHI, K_SPLITS)
    valid = ids_TK < num  # transformers marks a dropped slot with id E: it adds nothing
    picked = y_ETH[ids_TK.clamp(max=num - 1), torch.arange(tokens, device=ids_TK.device)[:, None]]
    slots = (picked * weights_TK.unsqueeze(-1)).to(hidden_TH.dtype)  # [T, K, H]
    return torch.where(valid.unsqueeze(-1), slots, torch.zeros((), dtype=slots.dtype))


def tile_groups(counts: list[int], device: Any = None) -> tuple[list[int], torch.Tensor]:
    """Rows of consecutive groups (``counts`` rows each) laid out with each group padded
    to whole ROWS tiles: (the padded sizes, each row's index in that layout)."""
    n = np.asarray(counts, dtype=np.int64)
    sizes = -(-n // ROWS) * ROWS
    gap = sizes - n  # padding per group
    # a row's index: its own, plus the padding of the groups before it
    dest = np.arange(int(n.sum())) + np.repeat(np.cumsum(gap) - gap, n)
    return sizes.tolist(), torch.as_tensor(dest, device=device)


GATHER_BYTES = 1 << 20
"""``grouped_tiles`` copies each tile's weight into one batch (one bmm for all groups)
when that copy is at most this many bytes (and ``GATHER_TILES`` allow); otherwise one
product per group. A copy that fits one core's L2 cache (1 MiB on this project's 2-core
CPU) saves the per-group products' calls; a larger one streams every tile's weight
through memory once more than a product per group, which reads each expert's weight
once: on the mid shape (tools/bench/engine.py: a down projection is 512×256, 0.5 MB in
fp32) a 32-row decode step copied 11 tiles' down projections, 5.6 MB, in 0.4 ms, and a
session's experts took 303–345 ms gathered (under 8 MiB) against 280–285 ms per group
(tools/bench/true_on_policy.py's batch, 4 alternating runs)."""

GATHER_TILES = 8
"""``grouped_tiles`` gathers weights only while the groups average at most this many
tiles: past it, copying a weight per tile costs more than a product per group
(measured on the tiny model's experts: a 768-token prefill's 24 tiles per expert,
1.65 ms gathered against 1.35 ms per group; a decode step's one or two, 0.19 against
0.28 ms)."""


def grouped_tiles(
    rows: torch.Tensor,
    sizes: list[int],
    weights: list[torch.Tensor] | torch.Tensor,
    splits: int = 1,
) -> torch.Tensor:
    """Each group's rows (``sizes``: whole ROWS tiles, ``tile_groups``) × its weight
    [N, K]ᵀ (a list, or stacked [G, N, K]), through the fixed-shape tile product (K-split
    ``splits`` ways). Small weights are gathered per tile into one batched product,
    large ones multiply group by group: the same products, the same bits."""
    n_out, k = weights[0].shape
    tiles = [size // ROWS for size in sizes]
    count = sum(tiles)
    if not count:
        return rows.new_zeros(0, n_out)
    small = count * n_out * k * weights[0].element_size() <= GATHER_BYTES
    blas = _bmm_is_blas(k // splits, n_out)
    if small and blas and count <= GATHER_TILES * len(sizes):
        stacked = weights if isinstance(weights, torch.Tensor) else torch.stack(weights)
        owner = torch.as_tensor(np.repeat(np.arange(len(sizes)), tiles), device=rows.device)
        per_tile = stacked.index_select(0, owner)  # [tiles, N, K]
        return _split_tiles(rows, per_tile, splits)
    parts = [
        _split_tiles(part, weight, splits)
        for part, weight, size in zip(rows.split(sizes), weights, sizes, strict=True)
        if size
    ]
    return torch.cat(parts)


def _tiles(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n·ROWS, K] × weight [N, K]ᵀ as n products of one [ROWS, K] × [K, N] shape;
    a weight [n, N, K] gives each tile its own.

    A shared weight of N ≥ 2 outputs multiplies all the tiles in one product: on the
    CPU that gives each tile the bits of its own product (measured for K 16-1024, N
    2-4096, up to 64 tiles, fp32 and bf16, 1 and 2 threads; tested against the tile
    products by tests/unit/test_batch_invariant.py). Fewer than 4 rows do not, which is
    why rows come in tiles. A single output column multiplies as two, the second zero:
    torch runs one-column products as matrix-vector products, and a batch of such tiles
    with one shared weight as one, so a row's bits changed with the number of rows
    beside it (fp32, K ≥ 32)."""
    if weight.shape[-2] == 1:
        return _tiles(rows, F.pad(weight, (0, 0, 0, 1)))[:, :1]
    if weight.dim() == 2:
        return tile_product.mm(rows, weight.t())
    tiles = rows.reshape(-1, ROWS, rows.shape[-1])
    return tile_product.bmm(tiles, weight.transpose(1, 2)).view(-1, weight.shape[-2])


_ROUTES: dict[Any, Callable[..., Any]] = {}


def _route(*funcs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for f in funcs:
            _ROUTES[f] = fn
        return fn

    return register


_route(F.linear)(lambda x, weight, bias=None: linear(x, weight, bias))
_route(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm)(matmul)
_route(torch.sum, torch.Tensor.sum)(sum_)
_route(torch.mean, torch.Tensor.mean)(mean)
_route(torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)(sigmoid)
_route(F.silu)(silu)
_route(torch.rsqrt, torch.Tensor.rsqrt)(rsqrt)
_route(F.scaled_dot_product_attention)(attention)


@_route(F.rms_norm, torch.rms_norm)
def _rms_norm_route(
    x: torch.Tensor, shape: Any, weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    if len(tuple(shape)) != 1:
        raise NotImplementedError(f"batch-invariant mode: an RMSNorm over {tuple(shape)}")
    return rms_norm(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)


_route(torch.logsumexp, torch.Tensor.logsumexp)(
    lambda x, dim, keepdim=False: logsumexp(x, _required_dim(dim, {}), keepdim)
)


@_route(torch.softmax, torch.Tensor.softmax, F.softmax)
def _softmax_route(x: torch.Tensor, dim: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    return softmax(x, int(_required_dim(dim, kwargs)), _dtype(args, kwargs))


@_route(torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax)
def _log_softmax_route(x: torch.Tensor, dim: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    return log_softmax(x, int(_required_dim(dim, kwargs)), _dtype(args, kwargs))


def _required_dim(dim: Any, kwargs: dict[str, Any]) -> int:
    dim = kwargs.get("dim", dim)
    if dim is None or isinstance(dim, (list, tuple)):
        raise NotImplementedError(f"batch-invariant mode: a softmax over dim={dim}")
    return int(dim)


def _dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The ``dtype`` of a softmax call: a keyword, or the positional one of torch's and
    the Tensor method's signatures (F.softmax's positional ``_stacklevel`` is not it)."""
    if "dtype" in kwargs:
        return kwargs["dtype"]  # type: ignore[no-any-return]
    found = [a for a in args if isinstance(a, torch.dtype)]
    return found[0] if found else None


def invariant(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run inside ``BatchInvariant``."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with BatchInvariant():
            return forward(*args, **kwargs)

    return run


def in_mode() -> bool:
    """Whether the calling code runs inside a ``BatchInvariant`` block."""
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[attr-defined]
    return any(isinstance(mode, BatchInvariant) for mode in stack)


class BatchInvariant(TorchFunctionMode):
    """Inside ``with BatchInvariant():`` the calls above run their batch-invariant
    versions; every other torch call runs as it is."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is None:
            return func(*args, **kwargs)
        if func in (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean) and args:
            first = args[0]
            if isinstance(first, torch.Tensor) and not first.is_floating_point():
                return func(*args, **kwargs)
        return route(*args, **kwargs)
