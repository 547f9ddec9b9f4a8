"""The config-driven Trainer on engine rollouts: steps publish versions, the objective
moves the policy, and a checkpoint resumes the version."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

from moerl.parallel import spawn
from moerl.trainer.replay_check import collect_rollouts


def _run(hf_dir: str, rollouts: str, ckpt: str, out: str, resume: bool) -> None:
    from moerl.algo.config import AlgoConfig, ReinforcePPConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.convert import HFCheckpoint
    from moerl.models.families import get_family
    from moerl.rollout.trajectory import load_jsonl
    from moerl.trainer.trainer import Trainer

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    cfg = TrainerConfig(lr=1e-3, checkpoint_dir=ckpt, resume=resume, use_distributed_optimizer=True)
    algo = AlgoConfig(advantage=ReinforcePPConfig())
    trainer = Trainer(model, ParallelConfig(), cfg, algo, CorrectionConfig(name="tis"), hf_dir=hf_dir)
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


def test_trainer_steps_and_resumes(tiny_checkpoints, tmp_path):
    hf = tiny_checkpoints["deepseek_moe"]
    rollouts = tmp_path / "r.jsonl"
    collect_rollouts(hf, rollouts, num_prompts=8, max_new_tokens=12, dtype="float32")
    spawn(_run, 1, str(hf), str(rollouts), str(tmp_path / "ckpt"), str(tmp_path / "a.json"), False)
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["version"] == 2 and a["first"]["version"] == 1.0
    # step 1 is on-policy: no mismatch; step 2 trains the same rollouts with a moved policy
    assert a["first"]["mismatch/log_ratio_abs_max"] < 1e-5
    assert a["second"]["mismatch/log_ratio_abs_max"] > 1e-4
    assert a["second"]["staleness/mean"] == 1.0  # the rollouts are one version old now
    # after two updates the trainer's fresh routing differs from the rollouts' on some tokens
    flips = a["flips"]
    assert set(flips) == {"router_flip/layer1", "router_flip/layer2", "router_flip/layer3", "router_flip/mean"}
    assert 0.0 < flips["router_flip/mean"] < 1.0
    spawn(_run, 1, str(hf), str(rollouts), str(tmp_path / "ckpt"), str(tmp_path / "b.json"), True)
    assert json.loads((tmp_path / "b.json").read_text())["version_after_resume"] == 2
