"""The CPU layer skips torch.distributed's blocking all-reduce and broadcast on groups of
one rank (moerl/compat/megatron_patches.py, ``collectives_skipped_when_alone``): they give
what torch's collective gives (the tensor as it is), and every other call (a group of
two, the default group of a two-rank world, an asynchronous call, a scaling reduction)
still reaches torch. Two gloo ranks; the calls that reach torch are counted by a spy that
runs torch's own function."""

from __future__ import annotations

import json
from pathlib import Path

from moerl.parallel import spawn


def _check(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from moerl.compat import megatron_patches

    rank = dist.get_rank()
    originals = {name: fn for owner, name, fn in megatron_patches._originals if owner is dist}
    record: dict = {
        "installed": sorted(n for n in originals if getattr(dist, n) is not originals[n])
    }
    groups = [dist.new_group([r]) for r in range(2)]  # every rank makes both
    mine, world = groups[rank], dist.new_group([0, 1])
    reached: list[str] = []

    def spy(name: str):  # torch's own function, counted
        def call(*args, **kwargs):
            reached.append(name)
            return originals[name](*args, **kwargs)

        return call

    all_reduce, broadcast = megatron_patches.collectives_alone(spy("all_reduce"), spy("broadcast"))

    def value() -> torch.Tensor:
        return torch.tensor([1.0 + rank, 10.0 * (rank + 1)])

    def case(name: str, fn, *args, **kwargs) -> None:
        reached.clear()
        t = value()
        work = fn(t, *args, **kwargs)
        if work is not None:
            work.wait()
        record[name] = {"reached": list(reached), "value": t.tolist()}

    # torch's own answer on a group of one: the tensor unchanged
    t = value()
    originals["all_reduce"](t, group=mine)
    record["torch_alone"] = t.tolist()
    case("alone", all_reduce, group=mine)
    case("alone_max", all_reduce, op=dist.ReduceOp.MAX, group=mine)
    case("alone_async", all_reduce, group=mine, async_op=True)
    case("world", all_reduce, group=world)
    case("default", all_reduce)
    case("bcast_alone", broadcast, src=rank, group=mine)
    case("bcast_world", broadcast, src=1, group=world)
    reached.clear()
    with _coalescing_manager(mine, async_ops=False):
        t = value()
        all_reduce(t, group=mine)
    record["coalesced"] = {"reached": list(reached), "value": t.tolist()}
    # a scaling reduction is never skipped (gloo has none: only its routing is checked)
    scaled: list[object] = []
    premul, _ = megatron_patches.collectives_alone(lambda *a, **k: scaled.append(k["op"]), None)
    premul(value(), op=dist._make_nccl_premul_sum(2.0), group=mine)
    record["premul_reached"] = len(scaled)
    Path(f"{out}.{rank}").write_text(json.dumps(record))


def test_blocking_collectives_on_a_group_of_one_skip_gloo_and_give_torchs_answer(tmp_path):
    out = tmp_path / "alone"
    spawn(_check, 2, str(out))
    for rank in range(2):
        r = json.loads(Path(f"{out}.{rank}").read_text())
        mine = [1.0 + rank, 10.0 * (rank + 1)]
        assert r["installed"] == ["all_reduce", "broadcast"]  # the CPU layer's ranks
        assert r["torch_alone"] == mine
        for name in ("alone", "alone_max", "bcast_alone", "coalesced"):
            assert r[name] == {"reached": [], "value": mine}, name
        assert r["alone_async"] == {"reached": ["all_reduce"], "value": mine}
        for name in ("world", "default"):
            assert r[name] == {"reached": ["all_reduce"], "value": [3.0, 30.0]}, name
        assert r["bcast_world"] == {"reached": ["broadcast"], "value": [2.0, 20.0]}
        assert r["premul_reached"] == 1
