"""The config-driven Trainer on engine rollouts: steps publish versions, the objective
moves the policy, and a checkpoint resumes the version."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from moerl.parallel import spawn
from moerl.checks.replay import collect_rollouts


def _run(hf_dir: str, rollouts: str, ckpt: str, out: str, resume: bool) -> None:
    from moerl.algo.config import AlgoConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.common.trajectory import load_jsonl
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    cfg = TrainerConfig(lr=1e-3, checkpoint_dir=ckpt, resume=resume, use_distributed_optimizer=True)
    algo = AlgoConfig(advantage=ReinforcePPConfig())
    trainer = Trainer(
        model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir
    )
    trajs = load_jsonl(rollouts)
    for t in trajs:
        t.reward = float(np.mean(t.response_ids % 2 == 0))
    if resume:
        record = {"version_after_resume": trainer.version}
    else:
        first = trainer.step(trajs)
        second = trainer.step(trajs)
        trainer.save(cursor=len(trajs))
        flips = trainer.router_flip_rates(trajs, sample=4)
        record = {"first": first, "second": second, "version": trainer.version, "flips": flips}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))


def _kl(hf_dir: str, rollouts: str, ckpt: str, out: str) -> None:
    from moerl.algo.config import AlgoConfig, KLConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.common.trajectory import load_jsonl
    from moerl.trainer.forward import trainer_logprobs
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    algo = AlgoConfig(advantage=ReinforcePPConfig(), kl=KLConfig(coef=0.5, kind="k3"))

    def make(resume: bool) -> Trainer:
        cfg = TrainerConfig(lr=1e-3, checkpoint_dir=ckpt, resume=resume)
        return Trainer(
            model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir
        )

    trainer = make(False)
    trajs = load_jsonl(rollouts)
    for t in trajs:
        t.reward = float(np.mean(t.response_ids % 2 == 0))
    first = trainer.step(trajs)
    policy = trainer_logprobs(
        trainer.chunks, trajs, num_layers=model.num_layers, topk=model.moe_router_topk
    ).logprobs
    ref = trainer.reference_logprobs(trajs)
    second = trainer.step(trajs)
    trainer.save()
    d = np.concatenate([ref[i] - policy[i] for i in range(len(trajs))]).astype(np.float64)
    expected = float(np.mean(np.expm1(d) - d))  # k3, token mean, by hand
    resumed = make(True).reference_logprobs(trajs)
    record = {
        "first_kl": first["kl/value"], "second_kl": second["kl/value"], "expected": expected,
        "ref_vs_rollout": max(float(np.abs(ref[i] - t.sampling_logprobs).max()) for i, t in enumerate(trajs)),
        "resumed_vs_ref": max(float(np.abs(resumed[i] - ref[i]).max()) for i in range(len(trajs))),
    }  # fmt: skip
    Path(out).write_text(json.dumps(record))


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_kl_to_reference_policy(tiny_checkpoints, tmp_path):
    """algo.kl: the reference is the initial policy (also after resume); the KL term is 0
    on the first step and equals the hand-computed k3 of the moved policy later."""
    hf = tiny_checkpoints["deepseek_moe"]
    rollouts = tmp_path / "r.jsonl"
    collect_rollouts(hf, rollouts, num_prompts=4, max_new_tokens=8, dtype="float32")
    spawn(_kl, 1, str(hf), str(rollouts), str(tmp_path / "ckpt"), str(tmp_path / "kl.json"))
    r = json.loads((tmp_path / "kl.json").read_text())
    assert abs(r["first_kl"]) < 1e-9
    # fresh fp32 rollouts were sampled by the reference (logprobs over the kept set)
    assert r["ref_vs_rollout"] < 1e-5
    assert r["second_kl"] > 1e-7
    assert r["second_kl"] == pytest.approx(r["expected"], rel=1e-4)
    assert r["resumed_vs_ref"] == 0.0


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_trainer_steps_and_resumes(tiny_checkpoints, tmp_path):
    hf = tiny_checkpoints["deepseek_moe"]
    rollouts = tmp_path / "r.jsonl"
    collect_rollouts(hf, rollouts, num_prompts=8, max_new_tokens=12, dtype="float32")
    spawn(_run, 1, str(hf), str(rollouts), str(tmp_path / "ckpt"), str(tmp_path / "a.json"), False)
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["version"] == 2 and a["first"]["version"] == 1.0
    # step 1 is on-policy: no mismatch; step 2 trains the same rollouts with a moved policy
    assert a["first"]["mismatch/log_ratio_abs_max"] < 1e-5
    assert a["first"]["mismatch/mean_abs_dlogp"] <= a["first"]["mismatch/log_ratio_abs_max"]
    assert a["second"]["mismatch/mean_abs_dlogp"] > 1e-5
    assert a["second"]["mismatch/log_ratio_abs_max"] > 1e-4
    assert a["second"]["staleness/mean"] == 1.0  # the rollouts are one version old now
    # after two updates the trainer's fresh routing differs from the rollouts' on some tokens
    flips = a["flips"]
    assert set(flips) == {
        "router_flip/layer1",
        "router_flip/layer2",
        "router_flip/layer3",
        "router_flip/mean",
    }
    assert 0.0 < flips["router_flip/mean"] < 1.0
    spawn(_run, 1, str(hf), str(rollouts), str(tmp_path / "ckpt"), str(tmp_path / "b.json"), True)
    assert json.loads((tmp_path / "b.json").read_text())["version_after_resume"] == 2


def _replay_none(hf_dir: str, rollouts: str, out: str) -> None:
    """Logprobs of the rollouts under their recorded routes and under deliberately wrong
    ones (every expert id + 1 mod E, so no token keeps its set), for replay=none and, as
    the control that the wrong routes matter when replayed, replay=all; then a
    replay=none step and its flip rates."""
    import copy

    from moerl.algo.config import AlgoConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.common.trajectory import load_jsonl
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    algo = AlgoConfig(advantage=ReinforcePPConfig())
    trajs = load_jsonl(rollouts)
    for t in trajs:
        t.reward = float(np.mean(t.response_ids % 2 == 0))
    wrong = copy.deepcopy(trajs)
    for t in wrong:
        t.routed_experts = (t.routed_experts + 1) % model.num_experts
    record: dict = {}
    for replay in ("all", "none"):  # 'none' last: it is the trainer that steps
        cfg = TrainerConfig(lr=1e-3, replay=replay, sampling_mask=False)
        trainer = Trainer(
            model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir
        )
        recorded = np.concatenate(trainer.policy_logprobs(trajs))
        misrouted = np.concatenate(trainer.policy_logprobs(wrong))
        record[replay] = float(np.abs(recorded - misrouted).max())
    record["step"] = trainer.step(wrong)
    record["flips"] = trainer.router_flip_rates(trajs, sample=4)
    # a policy of one's own logs its numbers: replay where unsure, which is everywhere here
    own = {"_target_": "replay_policies_for_tests.small_margin", "threshold": 1e9}
    cfg = TrainerConfig(lr=1e-3, replay=own, sampling_mask=False)
    mine = Trainer(model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir)
    record["own"] = mine.step(trajs)
    record["flips_wrong"] = trainer.router_flip_rates(wrong, sample=4)
    Path(out).write_text(json.dumps(record))


def test_trainer_without_replay_steps(tiny_checkpoints, tmp_path):
    """trainer.replay=none (the plain router, the Keep Routing ablation) ignores the
    recorded routes: wrong ones give the same logprobs, which they change under
    replay=all; it trains on them, and the flip-rate probe still measures the fresh routes
    against the rollout's."""
    hf = tiny_checkpoints["deepseek_moe"]
    rollouts = tmp_path / "r.jsonl"
    collect_rollouts(hf, rollouts, num_prompts=4, max_new_tokens=8, dtype="bfloat16")
    spawn(_replay_none, 1, str(hf), str(rollouts), str(tmp_path / "none.json"))
    record = json.loads((tmp_path / "none.json").read_text())
    assert record["all"] > 1e-2  # replayed, the wrong routes move the logprobs
    assert record["none"] == 0.0  # not replayed: the router's own choices, whatever recorded
    # the step's training forward routes freshly too: it equals π_old (ratio 1), which a
    # forward replaying the wrong routes would not
    assert abs(record["step"]["loss/ratio_max"] - 1.0) < 1e-6
    assert abs(record["step"]["loss/approx_kl"]) < 1e-9
    assert record["step"]["version"] == 1.0 and np.isfinite(record["step"]["loss"])
    assert record["flips"] and all(0.0 <= v <= 1.0 for v in record["flips"].values())
    # the fresh routes are near the rollout's, nowhere near sets that share no token's
    assert record["flips"]["router_flip/mean"] < 0.5 < record["flips_wrong"]["router_flip/mean"]
    # issue 31: a replay policy's own metrics reach the step's metrics, averaged per key
    own = record["own"]
    assert own["replay/replayed_frac"] == 1.0  # an infinite threshold replays every token
    assert 1.0 <= own["replay/layer"] <= 4.0  # the mean of the MoE layers' numbers


def _decomposed(hf_dir: str, rollouts: str, out: str) -> None:
    """The mismatch decomposition of trajectories without sampling masks (a sampling that
    truncates nothing records none): as it runs (two forwards), and with every
    trajectory claiming a mask (four forwards, the mask on and off each run)."""
    from unittest import mock

    from moerl.algo.config import AlgoConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.common.trajectory import Trajectory, load_jsonl
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.trainer import forward
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    trainer = Trainer(
        model, ParallelConfig(), TrainerConfig(lr=1e-3), AlgoConfig(advantage=ReinforcePPConfig()),
        CorrectionConfig(name="tis"), hf_dir=hf_dir,
    )  # fmt: skip
    trajs = load_jsonl(rollouts)
    for t in trajs:
        t.mask_ids = t.mask_offsets = t.sampling_logprobs = None
    forwards = []
    counted = forward.trainer_logprobs

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        forwards.append((kwargs["replay"], kwargs["use_mask"]))
        return counted(*args, **kwargs)

    with mock.patch.object(forward, "trainer_logprobs", counting):
        two = trainer.mismatch_decomposition(trajs, sample=4)
        n_two = len(forwards)
        with mock.patch.object(Trajectory, "has_sampling_mask", property(lambda self: True)):
            four = trainer.mismatch_decomposition(trajs, sample=4)
    Path(out).write_text(json.dumps({"two": two, "four": four, "n_two": n_two,
                                     "n_four": len(forwards) - n_two}))  # fmt: skip


def test_the_decomposition_without_masks_runs_two_forwards_with_the_same_numbers(
    tiny_checkpoints, tmp_path
):
    hf = tiny_checkpoints["deepseek_moe"]
    rollouts = tmp_path / "r.jsonl"
    collect_rollouts(hf, rollouts, num_prompts=4, max_new_tokens=8, dtype="float32")
    spawn(_decomposed, 1, str(hf), str(rollouts), str(tmp_path / "d.json"))
    r = json.loads((tmp_path / "d.json").read_text())
    assert (r["n_two"], r["n_four"]) == (2, 4)
    assert r["two"] == r["four"] and "router_flip/mean" in r["two"], r
