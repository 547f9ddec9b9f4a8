"""Full-weight sync latency: bucketed broadcasts vs one broadcast per tensor, side by side.

    python tools/bench/weight_sync.py [--mid] [--buckets-mb 1 16 64 256] [--reps 3]

One embedded engine, trainer rank 0 in this process (``moerl.sync.weights``), the
checkpoint's own HF tensors as the stream. For each bucket size, the best of ``reps``
full syncs; the per-tensor baseline is SGLang's unbucketed path (one
``/update_weights_from_distributed`` naming every tensor, then one broadcast each).
Prints one line per setting and

    best_bucket_mb=… bucketed_s=… per_tensor_s=… speedup=…

``--mid`` adds a Qwen3-MoE-shaped model of ~45M parameters with random weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch


def _checkpoint(root: Path, mid: bool) -> Path:
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    if not mid:
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
    from moerl.sync.group import broadcast

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


def bench(model_dir: Path, buckets_mb: list[float], reps: int) -> dict:
    from moerl.engine.process import EngineProcess
    from moerl.sync.weights import WeightSync

    tensors = _tensors(model_dir)
    total_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    bucketed: dict[float, float] = {}
    version = 0
    with EngineProcess(model_dir, threads=1) as engine:
        for mb in buckets_mb:
            with WeightSync([], None, urls=[engine.url], bucket_mb=mb) as sync:
                times = []
                for _ in range(reps):
                    version += 1
                    times.append(sync.push(version, named=tensors.items())["seconds"])
                bucketed[mb] = min(times)
            print(f"  bucket_mb={mb:g} seconds={bucketed[mb]:.4f}", flush=True)
        with WeightSync([], None, urls=[engine.url]) as sync:
            per_tensor = min(_per_tensor(sync, tensors, version + 1 + i) for i in range(reps))
        print(f"  per_tensor seconds={per_tensor:.4f} ({len(tensors)} tensors)", flush=True)
    best = min(bucketed, key=bucketed.__getitem__)
    return {
        "model_mb": round(total_mb, 2),
        "tensors": len(tensors),
        "best_bucket_mb": best,
        "bucketed_s": bucketed[best],
        "per_tensor_s": per_tensor,
        "speedup": per_tensor / bucketed[best],
        "by_bucket_mb": bucketed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mid", action="store_true", help="also a ~45M-parameter model")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="moerl-bench-sync-") as tmp:
        for name in ["tiny", "mid"] if args.mid else ["tiny"]:
            model_dir = _checkpoint(Path(tmp), name == "mid")
            print(f"model={name}", flush=True)
            r = bench(model_dir, args.buckets_mb, args.reps)
            results[name] = r
            print(
                f"model={name} model_mb={r['model_mb']} best_bucket_mb={r['best_bucket_mb']:g} "
                f"bucketed_s={r['bucketed_s']:.4f} per_tensor_s={r['per_tensor_s']:.4f} "
                f"speedup={r['speedup']:.2f}",
                flush=True,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
