"""moerl.compat's uneven gather / reduce-scatter over gloo, against plain torch math."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moerl.parallel import spawn

SIZES = [3, 1, 4]


def _uneven(_: int) -> None:
    from megatron.core.tensor_parallel import mappings

    group = dist.group.WORLD
    rank = dist.get_rank()
    # rank r holds SIZES[r] rows filled with r + row index
    local = torch.arange(SIZES[rank] * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    gathered = mappings._gather_along_first_dim(local, group, output_split_sizes=SIZES)
    expected = torch.cat(
        [
            torch.arange(n * 2, dtype=torch.float32).view(-1, 2) + 100 * r
            for r, n in enumerate(SIZES)
        ]
    )
    assert torch.equal(gathered, expected), (gathered, expected)

    # reduce-scatter: every rank contributes (rank + 1) * full; rank r keeps its rows of the sum
    full = torch.arange(sum(SIZES) * 2, dtype=torch.float32).view(-1, 2)
    mine = mappings._reduce_scatter_along_first_dim(
        full * (rank + 1), group, input_split_sizes=SIZES
    )
    start = sum(SIZES[:rank])
    total = sum(r + 1 for r in range(len(SIZES)))
    assert torch.equal(mine, full[start : start + SIZES[rank]] * total)

    # equal splits still go through megatron-core's own collective
    even = mappings._gather_along_first_dim(torch.full((2, 2), float(rank)), group)
    assert torch.equal(even[2 * rank : 2 * rank + 2], torch.full((2, 2), float(rank)))


def test_uneven_gather_and_reduce_scatter_over_gloo():
    spawn(_uneven, len(SIZES), 0)


def _sum_across() -> None:
    from moerl.trainer.numerics import _SumAcross

    rank = dist.get_rank()
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = _SumAcross.apply(x, dist.group.WORLD)
    assert torch.equal(y, torch.full((2, 3), 3.0))  # 1 + 2
    # only rank 0 uses the sum (as the expert-TP experts return it): both partials get its
    # gradient, rank 1's through the backward's all-reduce
    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    (y * weight * (1.0 if rank == 0 else 0.0)).sum().backward()
    assert torch.equal(x.grad, weight), (rank, x.grad)


def test_sum_across_adds_forward_and_backward():
    """trainer.numerics' expert-TP sum (moerl/trainer/numerics.py _SumAcross) over gloo."""
    spawn(_sum_across, 2)
