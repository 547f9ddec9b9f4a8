"""kernels/tile_product.py: the fixed-configuration Triton product the batch-invariant
ops use on CUDA, run here in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU).

The kernel is checked against ``torch.bmm`` (values and gradients, ragged and strided
shapes), a row's result against the same row computed in other batches and shapes (bit
for bit), and ``kernels/batch_invariant.py``'s own invariance tests are rerun with the
kernel carrying every product. On a GPU the same checks, and the ops' probe, run through
tools/gpu (``probe_invariance.py``): the interpreter shows the kernel's logic, not the
bits of a GPU's MMA units."""

# B batch entries, M rows, K inner dim, N columns

from __future__ import annotations

import pytest
import test_batch_invariant as invariance
import torch

from moerl.device import has_cuda
from moerl.kernels import tile_product
from moerl.kernels.dispatch import backend, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (B, M, K, N): tiles of the ops (8 rows, 4-query attention tiles), K and N off the
# kernel's blocks, one column, one inner element, empty ones
SHAPES = [(3, 8, 64, 96), (3, 16, 64, 96), (5, 4, 24, 48), (2, 37, 100, 70), (4, 16, 16, 1), (2, 3, 1, 5),
          (0, 4, 8, 8), (2, 3, 0, 5), (1, 70, 40, 130)]  # fmt: skip


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(shape, dtype, seed=0):  # type: ignore[no-untyped-def]
    b, m, k, n = shape
    a = torch.randn(b, m, k, generator=_gen(seed)).to(dtype)
    w = torch.randn(b, k, n, generator=_gen(seed + 1)).to(dtype)
    return a, w


def _kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with backend("triton"):
        return tile_product.bmm(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_torchs_product(shape, dtype):
    a, b = _pair(shape, dtype)
    got = _kernel(a, b)
    assert got.dtype == dtype and got.shape == (shape[0], shape[1], shape[3])
    want = torch.bmm(a.float(), b.float())
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_the_kernel_reads_any_strides():
    """A shared weight expanded over the batch (stride 0), transposed operands and a
    slice of a wider buffer, as the batch-invariant ops pass them."""
    gen = _gen(3)
    weight = torch.randn(48, 40, generator=gen)  # [N, K]
    tiles = torch.randn(5, 16, 40, generator=gen)
    shared = weight.t().expand(5, 40, 48)
    torch.testing.assert_close(_kernel(tiles, shared), torch.bmm(tiles, shared))
    wide = torch.randn(5, 16, 90, generator=gen)[..., 10:50]  # a row stride of 90
    keys = torch.randn(5, 30, 40, generator=gen).transpose(1, 2)  # [B, K, N] transposed
    torch.testing.assert_close(_kernel(wide, keys), torch.bmm(wide, keys))
    with backend("triton"):
        torch.testing.assert_close(tile_product.mm(tiles[0], weight.t()), tiles[0] @ weight.t())
    with pytest.raises(TypeError, match="cast one first"):
        tile_product.bmm(tiles, shared.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_in_any_batch_and_shape(dtype):
    """The kernel's promise: row r of entry e gives the bits it gives alone, whatever the
    batch count, the rows beside it (M), its place in a block, and the columns (N)."""
    gen = _gen(4)
    row = torch.randn(1, 1, 72, generator=gen).to(dtype)
    weight = torch.randn(1, 72, 50, generator=gen).to(dtype)
    alone = _kernel(row, weight)[0, 0]
    for batch, m, at in [(1, 16, 0), (1, 16, 15), (3, 40, 17), (7, 4, 3), (2, 70, 69)]:
        a = torch.randn(batch, m, 72, generator=gen).to(dtype)
        a[batch - 1, at] = row[0, 0]
        b = torch.randn(batch, 72, 50, generator=gen).to(dtype)
        b[batch - 1] = weight[0]
        assert torch.equal(_kernel(a, b)[batch - 1, at], alone), (batch, m, at)
    wider = torch.cat([weight, torch.randn(1, 72, 90, generator=gen).to(dtype)], dim=-1)
    assert torch.equal(_kernel(row, wider)[0, 0, :50], alone)  # more columns beside


def test_the_kernels_gradients_are_torchs():
    a, b = _pair((3, 20, 33, 17), torch.float32, seed=5)
    g = torch.randn(3, 20, 17, generator=_gen(7))
    grads = []
    for run in (_kernel, torch.bmm):
        leaf_a, leaf_b = a.clone().requires_grad_(), b.clone().requires_grad_()
        grads.append(torch.autograd.grad(run(leaf_a, leaf_b), (leaf_a, leaf_b), g))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_invariant_ops_keep_their_promise_through_the_kernel(dtype):
    """kernels/batch_invariant.py's own checks (each op close to torch's, a row's bits
    the same in any batch, prefill and decode, beside a prefix, a token's experts alone
    or among others), with every product of the ops run by the kernel."""
    with backend("triton"):
        invariance.test_linear_gives_a_row_the_same_bits_in_any_batch(dtype, 64, 96)
        invariance.test_attention_matches_sdpa(dtype)
        for kv_heads in (4, 2):
            invariance.test_a_query_gets_the_same_bits_in_prefill_decode_padded_and_beside_a_prefix(
                dtype, 40, kv_heads
            )
        for every_expert in (True, False):  # both of the experts' paths
            with pytest.MonkeyPatch.context() as patch:
                invariance.test_experts_match_a_loop_and_a_token_alone(patch, dtype, every_expert)
        invariance.test_rms_norm_is_transformers_formula_and_rerouted_from_torch(dtype)
    with backend("triton"):
        invariance.test_row_sums_give_a_row_the_same_bits_in_any_batch(64)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_a_row_keeps_its_bits_where_cublas_did_not(dtype):
    """The H200's failure (tools/gpu/probe_invariance.py): a [16, K] tile's rows got
    other bits once the batch held 16 or more tiles. Through the kernel, the same row in
    1 to 257 tiles, at the first, middle and last tile, keeps the bits it has alone."""
    gen = _gen(9)
    tile = torch.randn(1, 16, 1024, generator=gen).to("cuda", dtype)
    weight = torch.randn(1024, 512, generator=gen).to("cuda", dtype)
    alone = _kernel(tile, weight.expand(1, -1, -1))[0]
    for tiles in (1, 3, 16, 64, 257):
        for at in sorted({0, tiles // 2, tiles - 1}):
            batch = torch.randn(tiles, 16, 1024, generator=gen).to("cuda", dtype)
            batch[at] = tile[0]
            got = _kernel(batch, weight.expand(tiles, -1, -1))[at]
            assert torch.equal(got, alone), (tiles, at)
