"""One RL step on a device against the same step on the CPU: same weights, same batch.

    python tools/gpu/step_parity.py --device cuda --out DIR [--dtypes fp32 bf16]
        [--shapes tiny mid]

Makes a random HF checkpoint of the DeepSeek-MoE family per shape (``tiny``, and ``mid``:
the ~40M-parameter shape tools/bench/engine.py decodes with), collects rollouts with
routes from a CPU embedded engine, then runs one RL step (Keep Routing, sampling mask,
TIS, PPO clip, AdamW over megatron-core's DDP and optimizer, world size 1) twice per
(shape, dtype): in a process that sees no GPU (``CUDA_VISIBLE_DEVICES=``, gloo) and in
one on ``--device`` (NCCL), side by side. It prints one line per pair,

    step shape=… dtype=… loss_abs=… grad_norm_rel=… grad_rel=… update_rel=… ok=…

and writes them to ``DIR/result.json``. Relative errors: the losses' and grad norms'
|a-b| and |a-b|/|a|; ``grad_rel`` the largest ||g_dev - g_cpu|| / ||g_cpu|| over tensors;
``update_rel`` the same for the step's parameter change (p_after - p_before), which is
what Adam's first step makes of the gradients. ``--device cpu`` (the dry run) runs both
sides on the CPU, where they agree exactly.
"""

# T tokens

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# (loss_abs, grad_norm_rel, grad_rel, update_rel) ceilings. fp32: reduction order only.
# bf16: parameters and activations round at 2^-8 on both sides, differently; Adam's first
# update is near lr·sign(g), so a few sign flips of tiny gradients move update_rel most.
# The loss is compared absolutely: on-policy PPO with centred advantages sits near 0.
TOLERANCES = {"fp32": (1e-5, 1e-3, 1e-3, 2e-2), "bf16": (5e-3, 5e-2, 1e-1, 2.5e-1)}
KEYS = ("loss_abs", "grad_norm_rel", "grad_rel", "update_rel")
FAMILY = "deepseek_moe"


def _shape_config(shape: str) -> Any:
    from moerl.models.tiny import tiny_config

    cfg = tiny_config(FAMILY)
    if shape == "mid":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from engine import MID_SHAPE  # type: ignore[import-not-found]

        cfg = dataclasses.replace(cfg, **MID_SHAPE)
    return cfg


def _reward(t: Any) -> float:
    """A verifiable toy reward: the fraction of even token ids in the response."""
    return float(np.mean(t.response_ids % 2 == 0))


def worker(hf_dir: Path, rollouts: Path, dtype: str, out: Path) -> None:
    """One RL step in this process (a world of one rank); saves grads, params, metrics."""
    import torch

    from moerl.algo.advantages import AdvantageInput, build_advantage
    from moerl.algo.correction import build_correction
    from moerl.algo.losses import build_policy_loss
    from moerl.common.trajectory import load_jsonl
    from moerl.convert import HFCheckpoint, load_hf
    from moerl.models import get_family
    from moerl.models.gpt import build_model
    from moerl.parallel import parse_layout
    from moerl.parallel.full_state import allgather_sharded_grads, gather_full
    from moerl.parallel.spawn import single_process_world
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer.forward import trainer_logprobs
    from moerl.trainer.offpolicy import prepare
    from moerl.trainer.rl_step import rl_train_step
    from moerl.trainer.wrap import OptimConfig, attach_schedule_hooks, build_optimizer, wrap_ddp

    torch.manual_seed(0)
    single_process_world()
    model = get_family(FAMILY).from_hf(HFCheckpoint(hf_dir).config())
    pcfg, _ = parse_layout("single")
    initialize_model_parallel(
        pcfg, num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, num_experts=model.num_experts,
    )  # fmt: skip
    chunks = build_model(model, pcfg, dtype, routing_replay=True, per_token_loss=True)
    load_hf(chunks, hf_dir, model)
    ddp = wrap_ddp(chunks, use_distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimConfig(lr=1e-3, adam_eps=1e-6))
    attach_schedule_hooks(ddp, optimizer)
    before = gather_full([c.module for c in ddp], "param")
    trajs = load_jsonl(rollouts)
    rewards = torch.tensor([_reward(t) for t in trajs])
    adv = build_advantage("reinforce_pp")(
        AdvantageInput(rewards_S=rewards, group_ids_S=torch.arange(len(trajs)))
    )
    batching: dict[str, Any] = dict(num_layers=model.num_layers, topk=model.moe_router_topk,
                    num_experts=model.num_experts, micro_batch_size=1)  # fmt: skip
    old = trainer_logprobs(ddp, trajs, **batching)
    offpolicy = prepare(
        trajs, adv.advantages_S.tolist(), old_logprobs=[old.logprobs[i] for i in range(len(trajs))],
        correction_fn=build_correction("tis"), use_mask=True, current_version=0,
    )  # fmt: skip
    result = rl_train_step(
        ddp, optimizer, trajs, adv.advantages_S.tolist(), loss_fn=build_policy_loss("ppo_clip"),
        offpolicy=offpolicy, old_policy="recompute", step=False, **batching,
    )  # fmt: skip
    allgather_sharded_grads(ddp)
    grads = gather_full([c.module for c in ddp], "grad")
    grad_norm = float(optimizer.step()[1])
    after = gather_full([c.module for c in ddp], "param")
    assert before is not None and grads is not None and after is not None  # rank 0 of 1
    # on the CPU, so the comparing process loads both sides onto one device
    update = {k: (after.tensors[k] - before.tensors[k]).cpu() for k in after.tensors}
    grad = {k: v.cpu() for k, v in grads.tensors.items()}
    torch.save({"grad": grad, "update": update}, out / "tensors.pt")
    metrics = {"loss": float(result.loss or 0.0), "grad_norm": grad_norm}
    (out / "metrics.json").write_text(json.dumps(metrics))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare(cpu_dir: Path, dev_dir: Path) -> dict[str, float]:
    import torch

    ref, got = (json.loads((d / "metrics.json").read_text()) for d in (cpu_dir, dev_dir))
    a, b = (torch.load(d / "tensors.pt", map_location="cpu") for d in (cpu_dir, dev_dir))
    out = {"loss_abs": abs(ref["loss"] - got["loss"]),
           "grad_norm_rel": _rel(ref["grad_norm"], got["grad_norm"])}  # fmt: skip
    for kind in ("grad", "update"):
        errs = [float((a[kind][k] - b[kind][k].float()).norm() / a[kind][k].norm().clamp_min(1e-12))
                for k in a[kind]]  # fmt: skip
        out[f"{kind}_rel"] = max(errs)
    out.update(cpu_loss=ref["loss"], dev_loss=got["loss"], cpu_grad_norm=ref["grad_norm"],
               dev_grad_norm=got["grad_norm"])  # fmt: skip
    return out


def _run_worker(hf: Path, rollouts: Path, dtype: str, out: Path, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
               PYTHONWARNINGS="ignore:Transformer Engine and Apex")  # fmt: skip
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU: gloo, moerl.compat on
    argv = [sys.executable, __file__, "--worker", str(hf), str(rollouts), dtype, str(out)]
    subprocess.run(argv, env=env, check=True, timeout=600)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(TOLERANCES), default=["fp32", "bf16"])
    parser.add_argument("--shapes", nargs="+", choices=["tiny", "mid"], default=["tiny"])
    parser.add_argument("--prompts", type=int, default=8, help="rollouts in the batch")
    args = parser.parse_args(argv)
    from moerl.checks.replay import collect_rollouts
    from moerl.models.hf_tiny import save_tiny_checkpoint

    rows = []
    for shape in args.shapes:
        hf = save_tiny_checkpoint(_shape_config(shape), args.out / shape / "hf")
        rollouts = args.out / shape / "rollouts.jsonl"
        collect_rollouts(hf, rollouts, num_prompts=args.prompts, max_new_tokens=12)
        for dtype in args.dtypes:
            dirs = {side: args.out / shape / f"{dtype}-{side}" for side in ("cpu", "dev")}
            with ThreadPoolExecutor(2) as pool:  # the two sides at once, on separate processes
                jobs = [pool.submit(_run_worker, hf, rollouts, dtype, dirs["cpu"], "cpu"),
                        pool.submit(_run_worker, hf, rollouts, dtype, dirs["dev"], args.device)]  # fmt: skip
                for job in jobs:
                    job.result()
            row: dict[str, Any] = {"shape": shape, "dtype": dtype, "device": args.device}
            row.update(compare(dirs["cpu"], dirs["dev"]))
            limits = dict(zip(KEYS, TOLERANCES[dtype]))
            row["ok"] = all(row[k] <= v for k, v in limits.items())
            row["tolerances"] = limits
            print(f"step shape={shape} dtype={dtype} device={args.device} "
                  + " ".join(f"{k}={row[k]:.2e}" for k in KEYS)
                  + f" cpu_loss={row['cpu_loss']:.6f} dev_loss={row['dev_loss']:.6f}"
                  + f" ok={row['ok']}", flush=True)  # fmt: skip
            rows.append(row)
    (args.out / "result.json").write_text(json.dumps(rows, indent=2))
    if not all(r["ok"] for r in rows):
        raise SystemExit("step parity: some pair is outside its tolerances (see the lines above)")
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
    else:
        main()
