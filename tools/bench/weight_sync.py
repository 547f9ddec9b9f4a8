"""Full-weight sync at the limit of its transport: bucketed broadcasts vs one broadcast per
tensor vs one broadcast of the whole model, side by side.

    python tools/bench/weight_sync.py [--quick] [--configs tiny mid large]
                                      [--buckets-mb 1 16 64 256] [--reps 3] [--out DIR]

One embedded engine per config, trainer rank 0 in this process (``moerl.sync.weights``),
the checkpoint's own HF tensors as the stream. After one untimed warm-up sync per bucket
size, each repeat times, back to back (so the machine's load is shared alike):

- the reference: one broadcast of one contiguous tensor of the model's size, over a
  gloo group of the same shape (this process as rank 0, a receiver process that
  receives into one buffer kept across repeats): the best this transport can do;
- one full sync per bucket size;
- the per-tensor baseline: SGLang's unbucketed path (one ``/update_weights_from_distributed``
  naming every tensor, then one broadcast each);
- one full sync per bucket size over the same-host tensor path (``transport="tensor"``:
  the engine maps the buckets from shared memory, ``/update_weights_from_tensor``).

Medians over ``reps``. Prints, per config, one line per setting

    model=… bucket_mb=… sync_s=…
    model=… per_tensor_s=… tensors=…
    model=… ref_s=…

then one summary line per bucket size (GB/s of model bytes; ``frac_of_ref``: reference
time / sync time; ``vs_per_tensor``: per-tensor time / sync time)

    weight_sync model_mb=… bucket_mb=… sync_gbps=… ref_gbps=… frac_of_ref=… vs_per_tensor=…

and one per bucket size for the tensor path (``frac_of_memcpy``: one same-process copy of
the model's bytes / tensor-path time; ``vs_broadcast``: bucketed-broadcast time / tensor
time at the same bucket size)

    weight_sync transport=tensor model_mb=… bucket_mb=… sync_gbps=… memcpy_gbps=… frac_of_memcpy=… vs_broadcast=…

and then

    model=… model_mb=… best_bucket_mb=… bucketed_s=… per_tensor_s=… speedup=… tensor_s=… tensor_speedup=…

``result.json`` (with ``--out``) keeps every bucket's latency (``by_bucket_mb``, for a
latency-vs-bucket-size plot) and its fraction of the reference (``frac_of_ref``).
Configs: ``tiny`` (conf/model/deepseek_moe_tiny.yaml, ~1 MB), ``mid`` (a Qwen3-MoE shape
of ~45M parameters with random weights, ~180 MB fp32) and ``large`` (~237M parameters,
~0.9 GiB fp32; only when named: it takes minutes to write and load). ``--quick``: tiny
only, one repeat. ``--mid`` (kept from earlier versions) adds mid to ``--quick``.

The group is gloo on every machine: the embedded engine receives into CPU tensors, so a
NCCL group needs an engine that receives on its GPU (SGLang); the broadcast count and
bucket sizes, which set the speedup, are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

CONFIGS = ("tiny", "mid", "large")
DEFAULT_CONFIGS = ("tiny", "mid")
BACKEND = "gloo"  # see the module docstring


def _checkpoint(root: Path, name: str) -> Path:
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    if name == "tiny":
        return save_tiny_checkpoint(tiny_config("deepseek_moe"), root / "tiny")
    shape = SHAPES[name]
    return save_tiny_checkpoint(dataclasses.replace(tiny_config("qwen3_moe"), **shape), root / name)


SHAPES: dict[str, dict[str, Any]] = {  # Qwen3-MoE shapes, random weights
    "mid": dict(  # ~45M parameters, ~180 MB fp32
        num_layers=6, hidden_size=512, num_attention_heads=8, num_query_groups=4,
        kv_channels=64, ffn_hidden_size=1024, vocab_size=8192, num_experts=16,
        moe_ffn_hidden_size=256,
    ),
    "large": dict(  # ~237M parameters, ~0.9 GiB fp32
        num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
        kv_channels=64, ffn_hidden_size=2048, vocab_size=16384, num_experts=16,
        moe_ffn_hidden_size=512,
    ),
}  # fmt: skip


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _per_tensor(sync, tensors: dict[str, torch.Tensor], version: int) -> float:  # type: ignore[no-untyped-def]
    """SGLang's load_format=None path, through the sync's own group and event loop."""
    from moerl.engine.weights.group import broadcast

    start = time.perf_counter()
    sync._run(sync.client.begin_weight_update()).result(timeout=60)  # SGLang's session
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
    sync._run(sync.client.end_weight_update()).result(timeout=60)
    return time.perf_counter() - start


def _receive_reference(port: int, nbytes: int, count: int) -> None:
    """The reference's receiver (its own process): ``count`` broadcasts into one buffer."""
    from moerl.engine.weights.group import broadcast, init_custom_process_group

    torch.set_num_threads(1)
    group = init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, timeout_s=60)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(count):
        broadcast(group, buffer)


class Reference:
    """One broadcast of one contiguous tensor of ``nbytes`` to a receiver process (this
    script, run with ``--reference-receiver``)."""

    def __init__(self, nbytes: int, count: int) -> None:
        from moerl.engine.weights.group import init_custom_process_group
        from moerl.parallel.spawn import free_port

        port = free_port()
        role = f"{port}:{nbytes}:{count + 1}"
        self.process = subprocess.Popen(
            [sys.executable, "-W", "ignore", __file__, "--reference-receiver", role]
        )
        self.group = init_custom_process_group(BACKEND, "127.0.0.1", port, 0, 2, timeout_s=60)
        self.tensor = torch.ones(nbytes, dtype=torch.uint8)
        self.time()  # untimed warm-up: both buffers touched once

    def time(self) -> float:
        from moerl.engine.weights.group import broadcast

        start = time.perf_counter()
        broadcast(self.group, self.tensor)
        return time.perf_counter() - start

    def close(self) -> None:
        self.process.wait(timeout=60)


class Memcpy:
    """The same-host reference: one copy of ``nbytes`` between two buffers of this process
    (what the tensor path cannot beat: the engine still copies into its parameters)."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.time()  # untimed warm-up: both buffers touched once

    def time(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - start


def bench(name: str, model_dir: Path, buckets_mb: list[float], reps: int) -> dict[str, Any]:
    from moerl.engine.process import EngineProcess
    from moerl.sync.tensor_wire import share_cpu_tensors
    from moerl.sync.weights import WeightSync

    tensors = _tensors(model_dir)
    share_cpu_tensors()
    for t in tensors.values():  # where the trainer's parameters are under the tensor path
        t.share_memory_()  # (moerl.sync.tensor_wire.share_parameters): it reads them in place
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    total_mb = total / 2**20
    bucketed_all: dict[float, list[float]] = {mb: [] for mb in buckets_mb}
    tensor_all: dict[float, list[float]] = {mb: [] for mb in buckets_mb}
    ref_all: list[float] = []
    memcpy_all: list[float] = []
    per_tensor_all: list[float] = []
    version = 0
    with EngineProcess(model_dir, threads=1) as engine, ExitStack() as stack:
        syncs = {}
        for mb in buckets_mb:
            syncs[mb] = stack.enter_context(WeightSync(
                [], None, urls=[engine.url], bucket_mb=mb, backend=BACKEND,
                group_name=f"bench_{mb:g}",
            ))  # fmt: skip
            version += 1  # untimed warm-up: first-touch of the engine's and our buffers
            syncs[mb].push(version, named=tensors.items())
        tensor_syncs = {}
        for mb in buckets_mb:  # the same-host path: handles to shared buckets, no group
            tensor_syncs[mb] = stack.enter_context(WeightSync(
                [], None, urls=[engine.url], bucket_mb=mb, transport="tensor",
            ))  # fmt: skip
            version += 1
            tensor_syncs[mb].push(version, named=tensors.items())
        reference = Reference(total, reps)
        stack.callback(reference.close)
        memcpy = Memcpy(total)
        for _ in range(reps):  # interleaved: each repeat sees the same machine load
            ref_all.append(reference.time())
            memcpy_all.append(memcpy.time())
            for mb, sync in syncs.items():
                version += 1
                bucketed_all[mb].append(sync.push(version, named=tensors.items())["seconds"])
                version += 1
                pushed = tensor_syncs[mb].push(version, named=tensors.items())
                tensor_all[mb].append(pushed["seconds"])
            version += 1
            per_tensor_all.append(_per_tensor(syncs[buckets_mb[0]], tensors, version))
    bucketed = {mb: statistics.median(ts) for mb, ts in bucketed_all.items()}
    tensor = {mb: statistics.median(ts) for mb, ts in tensor_all.items()}
    ref, per_tensor = statistics.median(ref_all), statistics.median(per_tensor_all)
    copy_s = statistics.median(memcpy_all)
    for mb in buckets_mb:
        print(f"model={name} bucket_mb={mb:g} sync_s={bucketed[mb]:.4f}", flush=True)
    print(f"model={name} per_tensor_s={per_tensor:.4f} tensors={len(tensors)}", flush=True)
    print(f"model={name} ref_s={ref:.4f}", flush=True)
    gbps = {mb: total / s / 1e9 for mb, s in bucketed.items()}
    for mb in buckets_mb:
        print(
            f"weight_sync model_mb={total_mb:.2f} bucket_mb={mb:g} sync_gbps={gbps[mb]:.3f} "
            f"ref_gbps={total / ref / 1e9:.3f} frac_of_ref={ref / bucketed[mb]:.2f} "
            f"vs_per_tensor={per_tensor / bucketed[mb]:.2f}",
            flush=True,
        )
    for mb in buckets_mb:
        print(
            f"weight_sync transport=tensor model_mb={total_mb:.2f} bucket_mb={mb:g} "
            f"sync_gbps={total / tensor[mb] / 1e9:.3f} memcpy_gbps={total / copy_s / 1e9:.3f} "
            f"frac_of_memcpy={copy_s / tensor[mb]:.2f} vs_broadcast={bucketed[mb] / tensor[mb]:.2f}",
            flush=True,
        )
    best = min(bucketed, key=bucketed.__getitem__)
    best_tensor = min(tensor, key=tensor.__getitem__)
    return {
        "tensor_best_bucket_mb": best_tensor,
        "tensor_s": tensor[best_tensor],
        "tensor_speedup": bucketed[best] / tensor[best_tensor],
        "tensor_by_bucket_mb": {f"{mb:g}": s for mb, s in tensor.items()},
        "tensor_by_bucket_mb_all": {f"{mb:g}": ts for mb, ts in tensor_all.items()},
        "tensor_frac_of_memcpy": {f"{mb:g}": copy_s / s for mb, s in tensor.items()},
        "tensor_vs_broadcast": {f"{mb:g}": bucketed[mb] / s for mb, s in tensor.items()},
        "memcpy_s": copy_s,
        "memcpy_gbps": total / copy_s / 1e9,
        "model": name,
        "model_mb": round(total_mb, 2),
        "tensors": len(tensors),
        "best_bucket_mb": best,
        "bucketed_s": bucketed[best],
        "per_tensor_s": per_tensor,
        "speedup": per_tensor / bucketed[best],
        "ref_s": ref,
        "ref_gbps": total / ref / 1e9,
        "by_bucket_mb": {f"{mb:g}": s for mb, s in bucketed.items()},
        "by_bucket_mb_all": {f"{mb:g}": ts for mb, ts in bucketed_all.items()},
        "sync_gbps": {f"{mb:g}": g for mb, g in gbps.items()},
        "frac_of_ref": {f"{mb:g}": ref / s for mb, s in bucketed.items()},
        "vs_per_tensor": {f"{mb:g}": per_tensor / s for mb, s in bucketed.items()},
        "per_tensor_s_all": per_tensor_all,
        "ref_s_all": ref_all,
    }


def line(r: dict[str, Any]) -> str:
    return (
        f"model={r['model']} model_mb={r['model_mb']} best_bucket_mb={r['best_bucket_mb']:g} "
        f"bucketed_s={r['bucketed_s']:.4f} per_tensor_s={r['per_tensor_s']:.4f} "
        f"speedup={r['speedup']:.2f} tensor_s={r['tensor_s']:.4f} "
        f"tensor_speedup={r['tensor_speedup']:.2f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config only, one repeat")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help="default: tiny and mid (tiny only with --quick)")  # fmt: skip
    parser.add_argument("--mid", action="store_true", help="also the ~45M-parameter model")
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=None, help="syncs per setting (median; 3)")
    parser.add_argument("--out", type=Path, default=None, help="write result.json here")
    parser.add_argument("--reference-receiver", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reference_receiver is not None:  # PORT:NBYTES:COUNT, started by Reference
        port, nbytes, count = (int(x) for x in args.reference_receiver.split(":"))
        _receive_reference(port, nbytes, count)
        return {}
    names = args.configs or (["tiny"] if args.quick else list(DEFAULT_CONFIGS))
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
