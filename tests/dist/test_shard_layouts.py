"""Data-parallel ranks train on their shard of the batch alone (moerl.trainer.shard):
a DP=2 step that receives each rank's shard (others' trajectories without routes and
masks) equals the step that receives the whole batch on every rank, and both equal the
single process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from moerl.parallel import spawn
from moerl.checks.replay import collect_rollouts

# metrics that are not a function of the step's math
_NOT_MATH = ("seconds", "_s", "lr")


def _step(hf_dir: str, rollouts: str, out: str, mode: str) -> None:
    from moerl.algo.config import AlgoConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.common.trajectory import load_jsonl
    from moerl.trainer.shard import BatchScatter
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    cfg = TrainerConfig(lr=1e-3, minibatches=2)
    algo = AlgoConfig(advantage=ReinforcePPConfig())
    trainer = Trainer(
        model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir
    )
    trajs = load_jsonl(rollouts)
    for t in trajs:
        t.reward = float(np.mean(t.response_ids % 2 == 0))
    batch = trajs
    if mode == "shard":
        batch = BatchScatter(cfg.minibatches)(trajs if dist.get_rank() == 0 else None)
    whole = [i for i, t in enumerate(batch) if t.routed_experts is not None]
    metrics = trainer.step(batch, decompose_sample=4, flip_sample=4)
    after = trainer.policy_logprobs(batch)
    wholes: list = [None] * dist.get_world_size()
    dist.all_gather_object(wholes, whole)
    if dist.get_rank() == 0:
        record = {
            "metrics": metrics, "after": [a.tolist() for a in after], "whole": wholes,
        }  # fmt: skip
        Path(out).write_text(json.dumps(record))


@pytest.fixture(scope="module")
def rollouts(tiny_checkpoints, tmp_path_factory):
    hf = tiny_checkpoints["deepseek_moe"]
    path = tmp_path_factory.mktemp("rollouts") / "fp32.jsonl"
    collect_rollouts(hf, path, num_prompts=8, max_new_tokens=8, dtype="float32")
    return hf, path


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_dp2_step_on_shards_equals_the_whole_batch_and_one_process(rollouts, tmp_path):
    hf, path = rollouts
    runs = {}
    for name, world, mode in [("one", 1, "whole"), ("whole", 2, "whole"), ("shard", 2, "shard")]:
        out = tmp_path / f"{name}.json"
        spawn(_step, world, str(hf), str(path), str(out), mode)
        runs[name] = json.loads(out.read_text())
    n = len(runs["one"]["after"])
    # rank r of DP=2 with 2 minibatches holds its half of each minibatch whole, no more
    assert runs["shard"]["whole"] == [[0, 1, 4, 5], [2, 3, 6, 7]] and n == 8
    assert runs["whole"]["whole"] == [list(range(n))] * 2
    math = {k for k in runs["one"]["metrics"] if not k.endswith(_NOT_MATH)}
    assert {"loss", "grad_norm", "router_flip/mean", "mismatch/k3"} <= math
    for key in math:  # the same step: bit for bit on the same layout
        assert runs["shard"]["metrics"][key] == runs["whole"]["metrics"][key], key
    for a, b in zip(runs["shard"]["after"], runs["whole"]["after"]):
        assert a == b
    for key in ("loss", "grad_norm", "mismatch/k3", "router_flip/mean"):
        assert runs["shard"]["metrics"][key] == pytest.approx(
            runs["one"]["metrics"][key], rel=1e-4, abs=1e-7
        ), key
    for a, b in zip(runs["shard"]["after"], runs["one"]["after"]):
        assert np.allclose(a, b, atol=1e-5)


def _scatter_nothing_then_a_batch(out: str) -> None:
    from moerl.common.trajectory import Trajectory
    from moerl.config.parallel import ParallelConfig
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer.shard import BatchScatter

    initialize_model_parallel(ParallelConfig(), num_layers=2, num_attention_heads=2)  # DP=2
    scatter = BatchScatter(1)
    rank0 = dist.get_rank() == 0
    first = scatter(None)  # rank 0 has no batch yet (the loop pushes weights, asks again)
    batch = [
        Trajectory(prompt_ids=[1], response_ids=[2, i], response_logprobs=[0.0, 0.0], versions=[0, 0])
        for i in range(4)
    ]  # fmt: skip
    second = scatter(batch if rank0 else None)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (first, None if second is None else len(second)))
    if rank0:
        Path(out).write_text(json.dumps(seen))


def test_rank_0_without_a_batch_gives_every_rank_none(tmp_path):
    """moerl/loop.py's _next_batch: rank 0's None (a restarted engine wants the weights
    first) reaches every rank as None, and the next call scatters as usual."""
    out = tmp_path / "seen.json"
    spawn(_scatter_nothing_then_a_batch, 2, str(out))
    assert json.loads(out.read_text()) == [[None, 4], [None, 4]]


def _scatter_alone(out: str) -> None:
    from moerl.common.trajectory import Trajectory
    from moerl.config.parallel import ParallelConfig
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer.shard import BatchScatter

    initialize_model_parallel(ParallelConfig(), num_layers=2, num_attention_heads=2)
    scatter = BatchScatter(1)
    batch = [
        Trajectory(prompt_ids=[1], response_ids=[2, i], response_logprobs=[0.0, 0.0], versions=[0, 0],
                   routed_experts=np.zeros((2, 2, 1), dtype=np.int32))
        for i in range(4)
    ]  # fmt: skip
    got = scatter(batch)
    assert got is not None
    Path(out).write_text(
        json.dumps([scatter(None), [a is b for a, b in zip(got, batch)], got[0].routed_experts.shape])
    )


def test_one_process_keeps_its_batch_as_it_is(tmp_path):
    """A world of one: the batch is the rank's own (the same objects, routes whole), not a
    pickled copy of it; None stays None."""
    out = tmp_path / "alone.json"
    spawn(_scatter_alone, 1, str(out))
    assert json.loads(out.read_text()) == [None, [True] * 4, [2, 2, 1]]
