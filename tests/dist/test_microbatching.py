"""The step's micro-batching and its old-policy pass, on engine rollouts.

- π_old taken from the training forward (``trainer.old_policy_pass=auto``) gives the same
  loss, gradients and updated weights as the separate old-policy forward, bit for bit in
  fp32, for a token-level and a sequence-level correction.
- Micro-batches sized by tokens (``trainer.max_tokens_per_microbatch``), each padded to
  its own longest sequence, optimise the same objective as one sequence per micro-batch,
  on one process and with data and expert parallelism, where every rank runs the same
  number of micro-batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from offpolicy_rollouts_for_tests import noisy_trajectories

from moerl.checks.replay import collect_rollouts
from moerl.parallel import parse_layout, spawn

# small enough that the batch splits into several micro-batches of different lengths
BUDGET = 48


_trajectories = noisy_trajectories


def _correction(name: str):  # type: ignore[no-untyped-def]
    from moerl.algo.correction_config import OPSMConfig, TISConfig

    return {"tis": TISConfig(cap=1.5), "opsm": OPSMConfig(delta=1e-4)}[name]


def _steps(hf_dir: str, rollouts: str, layout: str, runs: list[tuple[str, ...]]) -> None:
    """One process group, several runs: each (out, correction, passes, budget) builds its
    own Trainer from the checkpoint and takes one step (saves a process start per run)."""
    for out, correction, passes, budget in runs:
        _step(hf_dir, rollouts, out, layout, correction, passes, int(budget))


def _step(
    hf_dir: str, rollouts: str, out: str, layout: str, correction: str, passes: str, budget: int
) -> None:
    """One Trainer step; writes the loss, grad norm, metrics, gradients, updated weights
    and this rank's micro-batch shapes (rank by rank)."""
    from megatron.core import parallel_state

    from moerl.algo.config import AlgoConfig, GRPOConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.trainer.batch import step_microbatches
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    parallel, _ = parse_layout(layout)
    cfg = TrainerConfig(
        lr=1e-2, adam_eps=1e-6, max_tokens_per_microbatch=budget, old_policy_pass=passes
    )
    algo = AlgoConfig(advantage=GRPOConfig(), old_policy="recompute")
    trainer = Trainer(model, parallel, cfg, algo, _correction(correction), hf_dir=hf_dir)
    trajs = _trajectories(rollouts)
    config = trainer.chunks[0].module.config
    mbs, _ = step_microbatches(
        config, trajs, micro_batch_size=1, use_routes=True, use_mask=True,
        topk=model.moe_router_topk, num_layers=model.num_layers, max_tokens=budget,
    )  # fmt: skip
    metrics = trainer.step(trajs)
    grads, weights = {}, {}
    for name, p in trainer.chunks[0].module.named_parameters():
        g = getattr(p, "main_grad", None)
        grads[name] = (p.grad if g is None else g).detach().clone()
        weights[name] = p.detach().clone()
    record = {
        "metrics": metrics,
        "grads": grads,
        "weights": weights,
        "shapes": [tuple(mb.tokens.shape) for mb in mbs],
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "old_from_forward": trainer.old_from_forward(),
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        torch.save(gathered, out)


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tmp_path_factory):
    hf = tiny_checkpoints["deepseek_moe"]
    tmp = tmp_path_factory.mktemp("microbatching")
    path = tmp / "r.jsonl"
    collect_rollouts(hf, path, num_prompts=8, max_new_tokens=8, dtype="float32")
    # name: layout, correction, old-policy pass, token budget (0 = one sequence each)
    plan = {
        "tis-auto": ("single", "tis", "auto", BUDGET),
        "tis-separate": ("single", "tis", "separate", BUDGET),
        "opsm-auto": ("single", "opsm", "auto", BUDGET),
        "opsm-separate": ("single", "opsm", "separate", BUDGET),
        "tis-sequences": ("single", "tis", "auto", 0),
        "tis-ep2": ("ep2", "tis", "auto", BUDGET),
    }
    by_layout: dict[str, list[tuple[str, ...]]] = {}
    for name, (layout, correction, passes, budget) in plan.items():
        run = (str(tmp / f"{name}.pt"), correction, passes, str(budget))
        by_layout.setdefault(layout, []).append(run)
    for layout, layout_runs in by_layout.items():
        spawn(_steps, parse_layout(layout)[1], str(hf), str(path), layout, layout_runs)
    return {n: torch.load(tmp / f"{n}.pt", weights_only=False) for n in plan}


@pytest.mark.parametrize("correction", ["tis", "opsm"])
def test_old_policy_from_the_forward_is_bit_identical(runs, correction):
    """No separate π_old forward, and nothing changes: loss, grad norm, every gradient
    and every updated weight equal the two-pass step's exactly (fp32, same micro-batches);
    the correction's metrics agree (token means taken per micro-batch, then weighted)."""
    (fused,), (separate,) = runs[f"{correction}-auto"], runs[f"{correction}-separate"]
    assert fused["old_from_forward"] and not separate["old_from_forward"]
    assert len(fused["shapes"]) > 1  # several micro-batches: the correction ran per part
    assert fused["metrics"]["loss"] == separate["metrics"]["loss"]
    assert fused["metrics"]["grad_norm"] == separate["metrics"]["grad_norm"]
    assert fused["metrics"]["grad_norm"] > 0
    for name, g in separate["grads"].items():
        assert torch.equal(fused["grads"][name], g), name
        assert torch.equal(fused["weights"][name], separate["weights"][name]), name
    keys = [k for k in separate["metrics"] if k.startswith(("is/", "mismatch/"))]
    assert keys
    for k in keys:
        assert fused["metrics"][k] == pytest.approx(separate["metrics"][k], rel=1e-6, abs=1e-9), k
    if correction == "tis":
        assert separate["metrics"]["is/clipped_frac"] > 0  # the weights differ from 1


def test_token_budget_micro_batches_pad_to_their_own_length(runs):
    """Within the budget, several sequences share a micro-batch, each micro-batch padded
    to its own longest sequence; the per-sequence run has one row each."""
    (tokens,), (sequences,) = runs["tis-auto"], runs["tis-sequences"]
    shapes = tokens["shapes"]
    assert all(rows == 1 or rows * length <= BUDGET for rows, length in shapes)
    assert max(rows for rows, _ in shapes) > 1
    assert len({length for _, length in shapes}) > 1  # not all padded to the longest
    assert sum(rows for rows, _ in shapes) == 8
    assert all(rows == 1 for rows, _ in sequences["shapes"]) and len(sequences["shapes"]) == 8


def test_token_budget_optimises_the_same_objective(runs):
    """Token-budget micro-batches and one sequence per micro-batch: the same loss and
    gradients up to fp32 summation order."""
    (tokens,), (sequences,) = runs["tis-auto"], runs["tis-sequences"]
    assert tokens["metrics"]["loss"] == pytest.approx(sequences["metrics"]["loss"], rel=1e-5)
    for name, g in sequences["grads"].items():
        torch.testing.assert_close(tokens["grads"][name], g, rtol=1e-4, atol=1e-6)


def test_token_budget_with_expert_and_data_parallelism(runs):
    """dp2 × ep2: each rank micro-batches its own half by tokens; both run the same number
    of micro-batches (the expert all-to-all pairs them), and the step's loss and grad
    norm equal the single process's."""
    ep2, (single,) = runs["tis-ep2"], runs["tis-auto"]
    counts = [len(r["shapes"]) for r in ep2]
    assert len(set(counts)) == 1 and counts[0] > 1
    assert sorted(r["dp_rank"] for r in ep2) == [0, 1]
    assert sum(rows for r in ep2 for rows, _ in r["shapes"]) == 8
    assert ep2[0]["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-5)
    assert ep2[0]["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-4)
