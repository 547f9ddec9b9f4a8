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
- adapter sync: ``AdapterSync.push`` as the trainer runs it (``gather_adapters``, load
  under a versioned name, unload of the previous version; end to end), once per
  transport (``sync.adapter_transport``): ``tensors`` (safetensors + base64 in the
  JSON body of /load_lora_adapter_from_tensors, decoded by the engine) and
  ``directory`` (a PEFT directory written to ``--adapter-dir``, default /dev/shm, and
  loaded by the engine with /load_lora_adapter); bytes = the safetensors payload.

Medians over ``--reps``. Prints, per config and transport,

    model=… transport=… rank=… full_bytes=… adapter_bytes=… bytes_ratio=… full_sync_s=… adapter_sync_s=… time_ratio=…

The bytes ratio is set by the layer shapes alone: a d×f weight against its rank-r pair
is d·f / (r·(d+f)), and the unadapted embedding and output layer count on the full
side; so a model with narrow experts (Qwen3-MoE: 2048×768) gains less than one with
wide ones (DeepSeek: 2048×1408, 7168×2048). Both mid shapes below are measured.

Configs: ``tiny`` (conf/model/deepseek_moe_tiny.yaml: MLA, shared expert, 8 experts),
``mid`` (a Qwen3-MoE shape, ~160M parameters, random weights; see ``MID``) and
``mid_ds`` (a DeepSeek-V2-Lite shape cut to 3 layers, ~250M; see ``MID_DS``).
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
# DeepSeek-V2-Lite's widths (hidden 2048, MLA without a q down-projection, kv rank 512,
# experts of width 1408, 2 shared, dense width 10944), cut to 1 dense + 2 MoE layers of
# 8 experts (top-4) and a 32k vocabulary to fit a CPU box: ~415M parameters (1.7 GB fp32).
MID_DS: dict[str, Any] = {
    "family": "deepseek_moe",
    "num_layers": 3,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "ffn_hidden_size": 10944,
    "vocab_size": 32768,
    "num_experts": 8,
    "moe_router_topk": 4,
    "moe_ffn_hidden_size": 1408,
    "moe_shared_expert_intermediate_size": 2816,
}
TARGETS = {"bytes_ratio": 50.0, "time_ratio": 20.0}  # issue 7, mid config at rank 16
CONFIGS = ("tiny", "mid", "mid_ds")
TRANSPORTS = ("tensors", "directory")


def model_config(name: str):  # type: ignore[no-untyped-def]
    from moerl.models.tiny import tiny_config

    if name == "tiny":
        return tiny_config("deepseek_moe")
    shapes = {"mid": MID, "mid_ds": MID_DS}
    if name in shapes:
        fields = {k: v for k, v in shapes[name].items() if k != "family"}
        return dataclasses.replace(tiny_config(shapes[name]["family"]), **fields)
    raise ValueError(f"unknown config {name!r}; choose 'tiny', 'mid' or 'mid_ds'")


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


def _codec_s(tensors) -> float:  # type: ignore[no-untyped-def]
    """Seconds to encode the adapter as the client does and decode it as the engine does."""
    import base64

    from safetensors.torch import load, save

    start = time.perf_counter()
    body = json.dumps({"safetensors_b64": base64.b64encode(save(tensors)).decode("ascii")})
    load(base64.b64decode(json.loads(body)["safetensors_b64"]))
    return time.perf_counter() - start


def _adapter_dir(root: Path) -> Path:
    """Where the directory transport writes: /dev/shm (memory) when there is one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else root
    return Path(tempfile.mkdtemp(prefix="moerl-bench-adapters-", dir=base))


def bench(
    name: str, root: Path, rank: int, reps: int, threads: int, transports: list[str]
) -> dict[str, Any]:
    import shutil

    import torch
    from safetensors.torch import save as safetensors_save

    from moerl.engine.process import EngineProcess
    from moerl.lora import gather_adapters, peft_config, resolve_targets
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.parallel.spawn import single_process_world
    from moerl.parallel.state import destroy
    from moerl.rollout.aio import EventLoopThread
    from moerl.rollout.client import EngineClient
    from moerl.sync.adapters import AdapterSync
    from moerl.sync.weights import WeightSync

    torch.set_num_threads(threads)
    model = model_config(name)
    t0 = time.perf_counter()
    hf_dir = save_tiny_checkpoint(model, root / name)
    single_process_world(backend="gloo")
    loop = EventLoopThread("moerl-bench-lora")
    adapter_dir = _adapter_dir(root)
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
            syncs = {
                t: AdapterSync(
                    lambda: gather_adapters(chunks, model),
                    config,
                    client=client,
                    run_coro=loop.submit,
                    prefix=t,
                    transport=t,
                    directory=adapter_dir,
                )  # fmt: skip
                for t in transports
            }
            full_s: list[float] = []
            adapter_s: dict[str, list[float]] = {t: [] for t in transports}
            split: dict[str, dict[str, list[float]]] = {t: {} for t in transports}
            full_bytes = 0
            with WeightSync(chunks, model, urls=[engine.url]) as sync:
                for version in range(1, reps + 1):  # side by side: full, then each transport
                    stats = sync.push(version)
                    full_s.append(stats["seconds"])
                    full_bytes = int(stats["bytes"])
                    report = f"  rep={version} full_s={full_s[-1]:.4f}"
                    for t, adapter_sync in syncs.items():
                        phases = adapter_sync.push(version)
                        adapter_s[t].append(phases["seconds"])
                        for key in ("gather_s", "load_s", "unload_s"):
                            split[t].setdefault(key, []).append(phases[key])
                        report += (f" {t}_s={phases['seconds']:.4f} (gather {phases['gather_s']:.4f}"
                                   f" load {phases['load_s']:.4f} unload {phases['unload_s']:.4f})")  # fmt: skip
                    print(report, flush=True)
                # the engine serves the last adapters (outside the timing)
                sampling = {"max_new_tokens": 2, "temperature": 0}
                for t in transports:
                    out = loop.run(
                        client.generate([5, 6, 7], sampling, lora_path=f"{t}-v{reps}"), 600
                    )
                    served = out["meta_info"]["weight_version"]
                    if served != str(reps):
                        raise RuntimeError(f"engine serves weight_version={served}, pushed {reps}")
            loop.run(client.aclose(), 60)
        tensors = gather_adapters(chunks, model)
    finally:
        loop.stop()
        destroy()
        shutil.rmtree(adapter_dir, ignore_errors=True)
    payload_bytes = len(safetensors_save(tensors))
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    full = _median(full_s)
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
        "full_sync_s_all": full_s,
        "transports": {
            t: {
                "adapter_sync_s": _median(adapter_s[t]),
                "time_ratio": full / _median(adapter_s[t]),
                "adapter_sync_s_all": adapter_s[t],
                # where the time goes (medians): gather; the load (encode or write, HTTP,
                # the engine's decode or read, and apply); the unload of the previous name
                "phases_s": {k: _median(v) for k, v in split[t].items()},
            }
            for t in transports
        },
        # the tensors transport's codec alone, replayed in this process: safetensors +
        # base64 + JSON and back (what the directory transport does not pay)
        "adapter_codec_s": _codec_s(tensors),
        "reps": reps,
    }


def line(r: dict[str, Any], transport: str) -> str:
    t = r["transports"][transport]
    return (
        f"model={r['model']} transport={transport} rank={r['rank']} "
        f"full_bytes={r['full_bytes']} adapter_bytes={r['adapter_bytes']} "
        f"bytes_ratio={r['bytes_ratio']:.1f} full_sync_s={r['full_sync_s']:.4f} "
        f"adapter_sync_s={t['adapter_sync_s']:.4f} time_ratio={t['time_ratio']:.1f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config only, one repeat")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--reps", type=int, default=5, help="repeats per config (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, trainer and engine")
    parser.add_argument("--configs", nargs="+", default=None, choices=CONFIGS, help="default: all")
    parser.add_argument(
        "--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS,
        help="adapter transports to measure (default: both)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write result.json here")
    args = parser.parse_args(argv)
    if args.rank < 1:
        parser.error(f"--rank={args.rank} must be >= 1")
    names = args.configs or (["tiny"] if args.quick else list(CONFIGS))
    reps = 1 if args.quick else args.reps
    results: dict[str, Any] = {
        "rank": args.rank,
        "reps": reps,
        "targets": TARGETS,
        "mid_config": MID,
        "mid_ds_config": MID_DS,
    }
    with tempfile.TemporaryDirectory(prefix="moerl-bench-lora-") as tmp:
        for name in names:
            print(f"model={name}", flush=True)
            r = bench(name, Path(tmp), args.rank, reps, args.threads, args.transports)
            results[name] = r
            for t in args.transports:
                print(line(r, t), flush=True)
                phases = " ".join(f"{k}={v:.4f}" for k, v in r["transports"][t]["phases_s"].items())
                print(f"  {t}: {phases}", flush=True)
            print(f"  tensors codec alone: {r['adapter_codec_s']:.4f}s", flush=True)
    if args.rank == 16:
        for name in ("mid", "mid_ds"):
            if name not in results:
                continue
            r = results[name]
            best = max(r["transports"], key=lambda t: r["transports"][t]["time_ratio"])
            met = (r["bytes_ratio"] >= TARGETS["bytes_ratio"]
                   and r["transports"][best]["time_ratio"] >= TARGETS["time_ratio"])  # fmt: skip
            print(f"issue target ({name}, rank 16): bytes_ratio>={TARGETS['bytes_ratio']:g} "
                  f"time_ratio>={TARGETS['time_ratio']:g} met={met} "
                  f"(bytes_ratio={r['bytes_ratio']:.1f}, best transport {best}: "
                  f"time_ratio={r['transports'][best]['time_ratio']:.1f})", flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
