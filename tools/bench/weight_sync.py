"""Full-weight sync latency: bucketed broadcasts vs one broadcast per tensor, side by side.

    python tools/bench/weight_sync.py [--quick] [--configs tiny mid]
                                      [--buckets-mb 1 16 64 256] [--reps 3] [--out DIR]

One embedded engine per config, trainer rank 0 in this process (``moerl.sync.weights``),
the checkpoint's own HF tensors as the stream. After one untimed warm-up sync, for each
bucket size the median of ``reps`` full syncs; the per-tensor baseline is SGLang's
unbucketed path (one ``/update_weights_from_distributed`` naming every tensor, then one
broadcast each), also the median of ``reps``. Prints, per config, one line per setting

    model=… bucket_mb=… sync_s=…
    model=… per_tensor_s=… tensors=…

and then

    model=… model_mb=… best_bucket_mb=… bucketed_s=… per_tensor_s=… speedup=…

``result.json`` (with ``--out``) keeps every bucket's latency (``by_bucket_mb``, for a
latency-vs-bucket-size plot). Configs: ``tiny`` (conf/model/deepseek_moe_tiny.yaml,
~1 MB) and ``mid`` (a Qwen3-MoE shape of ~45M parameters with random weights, ~180 MB
fp32). ``--quick``: tiny only, one repeat. ``--mid`` (kept from earlier versions) adds
mid to ``--quick``.

The group is gloo on every machine: the embedded engine receives into CPU tensors, so a
NCCL group needs an engine that receives on its GPU (SGLang); the broadcast count and
bucket sizes, which set the speedup, are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS = ("tiny", "mid")
BACKEND = "gloo"  # see the module docstring


def _checkpoint(root: Path, name: str) -> Path:
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    if name == "tiny":
        return save_tiny_checkpoint(tiny_config("deepseek_moe"), root / "tiny")
    cfg = dataclasses.replace(
        tiny_config("qwen3_moe"),
        num_layers=6,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=64,
        ffn_hidden_size=1024,
        vocab_size=8192,
        num_experts=16,
        moe_ffn_hidden_size=256,
    )
    return save_tiny_checkpoint(cfg, root / "mid")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _per_tensor(sync, tensors: dict[str, torch.Tensor], version: int) -> float:  # type: ignore[no-untyped-def]
    """SGLang's load_format=None path, through the sync's own group and event loop."""
    from moerl.engine.group import broadcast

    start = time.perf_counter()
    http = sync._run(
        sync.client.update_weights_from_distributed(
            list(tensors),
            [t.dtype for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
            group_name=sync.group_name,
            weight_version=str(version),
        )
    )
    for t in tensors.values():
        broadcast(sync._group, t.contiguous())
    http.result(timeout=600)
    return time.perf_counter() - start


def bench(name: str, model_dir: Path, buckets_mb: list[float], reps: int) -> dict[str, Any]:
    from moerl.engine.process import EngineProcess
    from moerl.sync.weights import WeightSync

    tensors = _tensors(model_dir)
    total_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    bucketed: dict[float, float] = {}
    bucketed_all: dict[float, list[float]] = {}
    version = 0
    with EngineProcess(model_dir, threads=1) as engine:
        with WeightSync(
            [], None, urls=[engine.url], bucket_mb=buckets_mb[0], backend=BACKEND
        ) as sync:
            version += 1  # untimed warm-up: the engine's first update pays one-off costs
            sync.push(version, named=tensors.items())
        for mb in buckets_mb:
            with WeightSync([], None, urls=[engine.url], bucket_mb=mb, backend=BACKEND) as sync:
                times = []
                for _ in range(reps):
                    version += 1
                    times.append(sync.push(version, named=tensors.items())["seconds"])
            bucketed_all[mb], bucketed[mb] = times, statistics.median(times)
            print(f"model={name} bucket_mb={mb:g} sync_s={bucketed[mb]:.4f}", flush=True)
        with WeightSync([], None, urls=[engine.url], backend=BACKEND) as sync:
            per_tensor_all = [_per_tensor(sync, tensors, version + 1 + i) for i in range(reps)]
        per_tensor = statistics.median(per_tensor_all)
        print(f"model={name} per_tensor_s={per_tensor:.4f} tensors={len(tensors)}", flush=True)
    best = min(bucketed, key=bucketed.__getitem__)
    return {
        "model": name,
        "model_mb": round(total_mb, 2),
        "tensors": len(tensors),
        "best_bucket_mb": best,
        "bucketed_s": bucketed[best],
        "per_tensor_s": per_tensor,
        "speedup": per_tensor / bucketed[best],
        "by_bucket_mb": {f"{mb:g}": s for mb, s in bucketed.items()},
        "by_bucket_mb_all": {f"{mb:g}": ts for mb, ts in bucketed_all.items()},
        "per_tensor_s_all": per_tensor_all,
    }


def line(r: dict[str, Any]) -> str:
    return (
        f"model={r['model']} model_mb={r['model_mb']} best_bucket_mb={r['best_bucket_mb']:g} "
        f"bucketed_s={r['bucketed_s']:.4f} per_tensor_s={r['per_tensor_s']:.4f} "
        f"speedup={r['speedup']:.2f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config only, one repeat")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help="default: all (tiny only with --quick)")  # fmt: skip
    parser.add_argument("--mid", action="store_true", help="also the ~45M-parameter model")
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=None, help="syncs per setting (median; 3)")
    parser.add_argument("--out", type=Path, default=None, help="write result.json here")
    args = parser.parse_args(argv)
    names = args.configs or (["tiny"] if args.quick else list(CONFIGS))
    if args.mid and "mid" not in names:
        names.append("mid")
    reps = args.reps or (1 if args.quick else 3)
    if reps < 1:
        parser.error(f"--reps={reps} must be >= 1")
    results: dict[str, Any] = {
        "backend": BACKEND,
        "reps": reps,
        "buckets_mb": args.buckets_mb,
        "configs": names,
    }
    with tempfile.TemporaryDirectory(prefix="moerl-bench-sync-") as tmp:
        for name in names:
            results[name] = bench(name, _checkpoint(Path(tmp), name), args.buckets_mb, reps)
            print(line(results[name]), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
