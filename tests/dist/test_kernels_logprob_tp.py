"""The logprob kernels with the vocabulary split over two tensor-parallel ranks (gloo
processes) equal one process and the dense reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
from kernels_logprob_cases import CHUNKS, FP32
from kernels_logprob_cases import kept_sets as _kept_sets
from kernels_logprob_cases import problem as _problem
from kernels_logprob_cases import reference as _reference
from kernels_logprob_cases import run as _run
from kernels_logprob_cases import trainer as _trainer

from moerl.kernels.dispatch import backend
from moerl.kernels.logprob import fused_logprobs, logprobs_from_logits
from moerl.parallel import spawn


def _shards_equal_whole(backend_name, p, shard, logits_TV, group):  # type: ignore[no-untyped-def]
    with backend(backend_name):
        whole = _run(fused_logprobs, p, [p["hidden"], p["weight"]], True, **CHUNKS)
        part = _run(fused_logprobs, p, [p["hidden"], p["weight"][shard]], True, tp_group=group,
                    **CHUNKS)  # fmt: skip
        whole_l = _run(logprobs_from_logits, p, [logits_TV], True)
        part_l = _run(logprobs_from_logits, p, [logits_TV[:, shard]], True, tp_group=group)
    for got, want in zip(part[:3] + part_l[:2], whole[:3] + whole_l[:2]):
        torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(part[3], whole[3][shard], **FP32)
    torch.testing.assert_close(part_l[2], whole_l[2][:, shard], **FP32)


def _sharded_equals_whole() -> None:
    """Rank r holds vocabulary [r·Vl, (r+1)·Vl): results, d hidden and the d weight /
    d logits shards equal the one-process ones, for the twin and the kernel; and the
    trainer's ``token_logprobs`` under megatron's own TP group equals the dense reference
    over the whole vocabulary (its d logits shard, that reference's slice)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = _problem(21, 150, 24)
    vocab_local = 150 // world
    shard = slice(rank * vocab_local, (rank + 1) * vocab_local)
    logits_TV = p["hidden"] @ p["weight"].T
    for name in ("torch", "triton"):
        _shards_equal_whole(name, p, shard, logits_TV, dist.group.WORLD)

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world, create_gloo_process_groups=True
    )
    trainer = _run(_trainer, p, [logits_TV[:, shard]], False)
    want_lp_T, want_d_logits_TV = _reference(p, logits_TV, _kept_sets(p), with_entropy=False)
    torch.testing.assert_close(trainer[0], want_lp_T, **FP32)
    torch.testing.assert_close(trainer[1], want_d_logits_TV[:, shard], **FP32)


def test_tp2_vocab_shards_equal_one_process():
    spawn(_sharded_equals_whole, 2)
