"""Adapter-only sync vs full-weight sync into one LoRA-enabled engine, side by side.

    python tools/bench/lora_sync.py [--quick] [--rank 16] [--reps 5] [--out DIR]

Per model config: a random HF checkpoint; one embedded engine started from it with
``--enable-lora`` (targets = every module the adapter covers, max rank = ``--rank``);
a megatron-core model built single-process in this process (one gloo rank,
``load_hf`` from the same checkpoint) with ``apply_lora`` on every linear
('all-linear': attention, dense MLP, shared and each routed expert). Each repeat runs
both, one after the other:

- full sync: ``WeightSync.push`` of every weight (``export_hf`` of the model, bucketed
  gloo broadcast + ``/update_weights_from_distributed``); bytes = the sync's own count
  (raw tensor bytes, fp32).
- adapter sync: ``gather_adapters`` + ``load_lora_adapter_from_tensors`` under a
  versioned name, then ``unload_lora_adapter`` of the previous version (time is end to
  end: gather, safetensors + base64 encoding, HTTP, the engine's decode and load, and
  the unload); bytes = the safetensors payload (before base64; the JSON body is 4/3 of it).

Medians over ``--reps``. Prints, per config,

    model=… rank=… full_bytes=… adapter_bytes=… bytes_ratio=… full_sync_s=… adapter_sync_s=… time_ratio=…

Configs: ``tiny`` (conf/model/deepseek_moe_tiny.yaml: MLA, shared expert, 8 experts)
and ``mid`` (a Qwen3-MoE shape, ~160M parameters, random weights; see ``MID``).
``--quick``: tiny only, one repeat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A Qwen3-MoE shape that fits a CPU box: GQA 16/4 heads of 64, 1 dense + 3 MoE layers
# of 16 experts (top-4, expert width 512), 32k vocabulary. ~162M parameters (650 MB fp32).
MID: dict[str, Any] = {
    "family": "qwen3_moe",
    "num_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 64,
    "ffn_hidden_size": 3072,
    "vocab_size": 32768,
    "num_experts": 16,
    "moe_router_topk": 4,
    "moe_ffn_hidden_size": 512,
}
TARGETS = {"bytes_ratio": 50.0, "time_ratio": 20.0}  # issue 7, mid config at rank 16


def model_config(name: str):  # type: ignore[no-untyped-def]
    from moerl.models.tiny import tiny_config

    if name == "tiny":
        return tiny_config("deepseek_moe")
    if name == "mid":
        fields = {k: v for k, v in MID.items() if k != "family"}
        return dataclasses.replace(tiny_config(MID["family"]), **fields)
    raise ValueError(f"unknown config {name!r}; choose 'tiny' or 'mid'")


def _single_process_group() -> None:
    """This process as a world of one gloo rank (megatron-core needs its groups)."""
    from moerl.parallel.spawn import free_port
    from moerl.parallel.state import init_process_group

    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        os.environ[key] = value
    init_process_group(backend="gloo")


def _trainer(model, hf_dir: Path, rank: int):  # type: ignore[no-untyped-def]
    """Megatron chunks loaded from ``hf_dir`` with LoRA applied, and the LoRA config."""
    from moerl.config.lora import LoraConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.convert import load_hf
    from moerl.lora import apply_lora
    from moerl.models.gpt import build_model
    from moerl.parallel.state import initialize_for_model

    pcfg = ParallelConfig()
    initialize_for_model(pcfg, model)
    chunks = build_model(model, pcfg)
    load_hf(chunks, hf_dir, model)
    cfg = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank)
    # B drawn nonzero, as after some training (zero B would be the same bytes anyway)
    apply_lora(chunks, cfg, model, b_std=0.01)
    return chunks, cfg


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _adapter_sync(loop, client, chunks, model, config, version: int, previous):  # type: ignore[no-untyped-def]
    """One adapter sync: gather, load under a versioned name, unload the previous one."""
    from moerl.lora import gather_adapters

    start = time.perf_counter()
    tensors = gather_adapters(chunks, model)
    gathered = time.perf_counter()
    answer = loop.run(
        client.load_lora_adapter_from_tensors(f"policy-v{version}", tensors, config), 600
    )
    (result,) = answer.values()
    if not result.get("success", False):
        raise RuntimeError(f"the engine refused the adapter: {result}")
    loaded = time.perf_counter()
    if previous is not None:
        loop.run(client.unload_lora_adapter(previous), 60)
    end = time.perf_counter()
    return {
        "total_s": end - start,
        "gather_s": gathered - start,
        "load_s": loaded - gathered,
        "unload_s": end - loaded,
    }


def _codec_s(tensors) -> float:  # type: ignore[no-untyped-def]
    """Seconds to encode the adapter as the client does and decode it as the engine does."""
    import base64

    from safetensors.torch import load, save

    start = time.perf_counter()
    body = json.dumps({"safetensors_b64": base64.b64encode(save(tensors)).decode("ascii")})
    load(base64.b64decode(json.loads(body)["safetensors_b64"]))
    return time.perf_counter() - start


def bench(name: str, root: Path, rank: int, reps: int, threads: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save as safetensors_save

    from moerl.engine.process import EngineProcess
    from moerl.lora import gather_adapters, peft_config, resolve_targets
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.parallel.state import destroy
    from moerl.rollout.aio import EventLoopThread
    from moerl.rollout.client import EngineClient
    from moerl.sync.weights import WeightSync

    torch.set_num_threads(threads)
    model = model_config(name)
    t0 = time.perf_counter()
    hf_dir = save_tiny_checkpoint(model, root / name)
    _single_process_group()
    loop = EventLoopThread("moerl-bench-lora")
    try:
        chunks, cfg = _trainer(model, hf_dir, rank)
        config = peft_config(cfg, model, str(hf_dir))
        targets = resolve_targets(cfg, model)
        params = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
        print(f"  model={name} built in {time.perf_counter() - t0:.1f}s "
              f"({params / 1e6:.1f}M base parameters)", flush=True)  # fmt: skip
        flags = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *targets]
        with EngineProcess(hf_dir, *flags, threads=threads, startup_timeout_s=600) as engine:
            client = EngineClient([engine.url], max_retries=0)
            full_s, adapter_s = [], []
            split: dict[str, list[float]] = {}
            full_bytes = 0
            loaded: str | None = None
            with WeightSync(chunks, model, urls=[engine.url]) as sync:
                for version in range(1, reps + 1):
                    stats = sync.push(version)
                    full_s.append(stats["seconds"])
                    full_bytes = int(stats["bytes"])

                    phases = _adapter_sync(loop, client, chunks, model, config, version, loaded)
                    loaded = f"policy-v{version}"
                    adapter_s.append(phases["total_s"])
                    for key in ("gather_s", "load_s", "unload_s"):
                        split.setdefault(key, []).append(phases[key])
                    print(f"  rep={version} full_s={full_s[-1]:.4f} adapter_s={adapter_s[-1]:.4f} "
                          f"(gather {phases['gather_s']:.4f} load {phases['load_s']:.4f} "
                          f"unload {phases['unload_s']:.4f})", flush=True)  # fmt: skip
                # the engine serves the last adapter (outside the timing)
                sampling = {"max_new_tokens": 2, "temperature": 0}
                out = loop.run(client.generate([5, 6, 7], sampling, lora_path=loaded), 600)
                served = out["meta_info"]["weight_version"]
                if served != str(reps):
                    raise RuntimeError(f"engine serves weight_version={served}, pushed {reps}")
            loop.run(client.aclose(), 60)
        tensors = gather_adapters(chunks, model)
    finally:
        loop.stop()
        destroy()
    payload_bytes = len(safetensors_save(tensors))
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    full, adapter = _median(full_s), _median(adapter_s)
    return {
        "model": name,
        "family": model.family,
        "rank": rank,
        "targets": targets,
        "base_params": params,
        "adapter_tensors": len(tensors),
        "full_bytes": full_bytes,
        "adapter_bytes": payload_bytes,
        "adapter_tensor_bytes": tensor_bytes,
        "bytes_ratio": full_bytes / payload_bytes,
        "full_sync_s": full,
        "adapter_sync_s": adapter,
        "time_ratio": full / adapter,
        "full_sync_s_all": full_s,
        "adapter_sync_s_all": adapter_s,
        # where the adapter sync's time goes (medians): gather, the HTTP load (client
        # encode + transfer + engine decode and apply), the unload of the previous name
        "adapter_phases_s": {k: _median(v) for k, v in split.items()},
        # the load's codec alone, replayed in this process: safetensors + base64 + JSON
        # and back (the part of load_s that a binary body would not pay)
        "adapter_codec_s": _codec_s(tensors),
        "reps": reps,
    }


def line(r: dict[str, Any]) -> str:
    return (
        f"model={r['model']} rank={r['rank']} full_bytes={r['full_bytes']} "
        f"adapter_bytes={r['adapter_bytes']} bytes_ratio={r['bytes_ratio']:.1f} "
        f"full_sync_s={r['full_sync_s']:.4f} adapter_sync_s={r['adapter_sync_s']:.4f} "
        f"time_ratio={r['time_ratio']:.1f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config only, one repeat")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="repeats per config (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, trainer and engine")
    parser.add_argument("--configs", nargs="+", default=None, help="subset of: tiny mid")
    parser.add_argument("--out", default=None, help="write result.json here")
    args = parser.parse_args(argv)
    if args.rank < 1:
        parser.error(f"--rank={args.rank} must be >= 1")
    names = args.configs or (["tiny"] if args.quick else ["tiny", "mid"])
    reps = 1 if args.quick else args.reps
    results: dict[str, Any] = {
        "rank": args.rank,
        "reps": reps,
        "targets": TARGETS,
        "mid_config": MID,
    }
    with tempfile.TemporaryDirectory(prefix="moerl-bench-lora-") as tmp:
        for name in names:
            print(f"model={name}", flush=True)
            r = bench(name, Path(tmp), args.rank, reps, args.threads)
            results[name] = r
            print(line(r), flush=True)
            phases = " ".join(f"{k}={v:.4f}" for k, v in r["adapter_phases_s"].items())
            print(f"  adapter_sync {phases} codec_s={r['adapter_codec_s']:.4f}", flush=True)
    if "mid" in results and args.rank == 16:
        mid = results["mid"]
        met = all(mid[k] >= v for k, v in TARGETS.items())
        print(f"issue target (mid, rank 16): bytes_ratio>={TARGETS['bytes_ratio']:g} "
              f"time_ratio>={TARGETS['time_ratio']:g} met={met}", flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
