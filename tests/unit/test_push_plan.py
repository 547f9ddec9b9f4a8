"""moerl/sync/plan.py: a recorded push replays the same buckets, byte for byte, as a
fresh ``bucketize`` of the changed parameters; what it cannot replay gives no plan."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moerl.sync.plan import PushPlan
from moerl.sync.stream import Bucket, Staging, bucketize


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(8, 4, generator=gen),  # fused gate/up: two views
        torch.randn(4, generator=gen),
        torch.randn(6, 3, generator=gen),
    ]


def _stream(params: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    fused, norm, other = params
    gate, up = fused.chunk(2, dim=0)
    yield "gate", gate
    yield "up", up
    yield "norm", norm
    yield "other.t", other.t()  # a strided view (not contiguous)


def _snapshot(buckets: list[tuple[Bucket, bool]]) -> list[tuple]:
    return [
        (b.names, b.dtypes, b.shapes, b.nbytes, last,
         None if b.flat is None else bytes(b.flat.numpy().tobytes()))
        for b, last in buckets
    ]  # fmt: skip


def _record(params, limit, dtype, staging) -> tuple[list, PushPlan | None]:  # type: ignore[no-untyped-def]
    items = list(PushPlan.record(_stream(params), params, limit, dtype, staging))
    return _snapshot(items[:-1]), items[-1]


@pytest.mark.parametrize(
    "limit, dtype", [(1 << 20, None), (80, None), (1 << 20, torch.bfloat16), (64, torch.float16)]
)
def test_a_replay_gives_what_a_fresh_push_would(limit, dtype):
    params = _params()
    staging = Staging(limit)
    recorded, plan = _record(params, limit, dtype, staging)
    assert plan is not None
    assert recorded == _snapshot(list(bucketize(_stream(params), limit, dtype, Staging(limit))))
    with torch.no_grad():  # the optimizer steps: the values change in place
        for p in params:
            p.mul_(-1.5).add_(0.25)
    assert plan.valid()
    want = _snapshot(list(bucketize(_stream(params), limit, dtype, Staging(limit))))
    assert _snapshot(list(plan.buckets(staging))) == want
    assert _snapshot(list(plan.buckets(staging))) == want  # again, from the other buffer


def test_a_replay_of_large_parameters_follows_their_in_place_updates():
    """Pieces of at least ``LARGE`` elements are copied by one memcpy each, the rest in
    one ``_foreach_copy_``; both read views made once, which must follow the optimizer's
    in-place updates of parameters that require grad."""
    from moerl.sync.plan import LARGE

    gen = torch.Generator().manual_seed(1)
    big = torch.nn.Parameter(torch.randn(2 * LARGE // 64, 64, generator=gen))
    params = [big, torch.nn.Parameter(torch.randn(4, generator=gen))]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        upper, lower = big.chunk(2, dim=0)  # LARGE elements each, contiguous
        yield "upper", upper
        yield "small", params[1]
        yield "lower", lower
        yield "lower.t", lower.t()  # large but strided: not one memcpy

    limit = 1 << 22
    staging = Staging(limit)
    items = list(PushPlan.record(stream(), params, limit, None, staging))
    plan = items[-1]
    assert plan is not None
    for round_ in range(3):
        with torch.no_grad():
            for p in params:
                p.mul_(0.5).add_(round_)
        want = _snapshot(list(bucketize(stream(), limit, None, Staging(limit))))
        assert _snapshot(list(plan.buckets(staging))) == want


def test_a_tensor_that_is_not_a_view_gives_no_plan():
    params = _params()

    def copied() -> Iterator[tuple[str, torch.Tensor]]:
        yield from _stream(params)
        yield "made", params[1] * 2  # computed: no parameter holds it

    items = list(PushPlan.record(copied(), params, 1 << 20, None, Staging(1 << 20)))
    assert items[-1] is None and len(items) == 2  # the buckets still came, as exported


def test_a_tensor_larger_than_a_bucket_gives_no_plan():
    params = _params()
    items = list(PushPlan.record(_stream(params), params, 40, None, Staging(40)))
    assert items[-1] is None  # "gate" (64 bytes) went alone, from its own bytes


def test_a_plan_no_longer_holds_once_a_parameter_moves():
    params = _params()
    _, plan = _record(params, 1 << 20, None, Staging(1 << 20))
    assert plan is not None and plan.valid()
    params[2].data = params[2].data.clone()
    assert not plan.valid()


def test_row_blocks_end_to_end_in_one_storage_export_as_a_view():
    """moerl/convert/exporter.py ``_adjacent``: megatron-core's sharded state dict splits a
    fused gate/up weight in two row blocks of one parameter; one rank exports it as a
    view of that parameter, equal to the concatenation. Blocks of separate tensors, or
    out of place, give None (the export then copies them together)."""
    from moerl.convert.exporter import _adjacent
    from moerl.parallel.full_state import Shard

    fused = torch.arange(24.0).reshape(6, 4)
    gate, up = fused.chunk(2, dim=0)
    pieces = [Shard("k", (2, 6, 4), (1, 3, 0), 1, up), Shard("k", (2, 6, 4), (1, 0, 0), 1, gate)]
    view = _adjacent(pieces, (6, 4))
    assert view is not None and torch.equal(view, fused)
    assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    apart = [Shard("k", (6, 4), (0, 0), 0, gate.clone()), Shard("k", (6, 4), (3, 0), 0, up.clone())]
    assert _adjacent(apart, (6, 4)) is None
    swapped = [Shard("k", (6, 4), (0, 0), 0, up), Shard("k", (6, 4), (3, 0), 0, gate)]
    assert _adjacent(swapped, (6, 4)) is None
    columns = [Shard("k", (4, 6), (0, 0), 0, gate.t()), Shard("k", (4, 6), (0, 3), 0, up.t())]
    assert _adjacent(columns, (4, 6)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replay_copies_gpu_parameters_into_cpu_staging():
    """A gloo push of a GPU model stages on the CPU: the plan's pieces then cross devices
    (one copy_ each, not the same-device foreach or memcpy)."""
    params = [p.cuda() for p in _params()]
    staging = Staging(1 << 20)
    _, plan = _record(params, 1 << 20, None, staging)
    assert plan is not None
    with torch.no_grad():
        for p in params:
            p.mul_(2.0)
    cpu = [p.cpu() for p in params]
    want = _snapshot(list(bucketize(_stream(cpu), 1 << 20, None, Staging(1 << 20))))
    assert _snapshot(list(plan.buckets(staging))) == want
