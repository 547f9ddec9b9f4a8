"""Cost curves: how trainer, weight sync and engine costs grow with the model, the
sequence and top-k, beside what the arithmetic says they should.

    python tools/bench/scaling.py [--quick | --smoke] [--sweeps hidden experts seq topk]
                                  [--reps 2] [--out DIR]

Sweeps (Qwen3-MoE shapes, every layer MoE, fp32, random weights; ``scaling_model.py``):

- ``hidden``: hidden size (head dim, expert ffn = h/2 grow with it), 8 experts, top-2;
- ``experts``: number of experts at h=256, top-2;
- ``seq``: tokens per sequence, 256 → 8K, at h=128 (one model, the workload grows);
- ``topk``: experts per token 2 → 8 of 16, at h=256.

Per point, each in this process with one torch thread (the engine: its own process,
one thread), medians of ``--reps`` after one untimed warm-up:

- ``step_s``: ``Trainer.step`` (π_old forward, forward + backward, Adam; one gloo rank,
  micro-batches of one sequence) on synthetic trajectories: 4 of 256 tokens (the seq
  sweep: 2 of S tokens);
- ``peak_mb``: the rank's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the point) minus the resident set just before its
  trainer was built, so weights, grads, Adam state and the peak activations; glibc is told to
  ``mmap`` every block over 128 KB, so freed tensors leave the resident set at once;
- ``sync_s``: ``WeightSync.push`` of the trainer's weights (``export_hf`` stream, 64 MB
  buckets, gloo) into the engine (model sweeps only: the bytes do not change otherwise);
- ``ttft_s``: a lone streamed request's first token, prompt of 128 tokens (the seq sweep:
  S tokens);
- ``decode_tok_s``: generated tokens/s of 4 concurrent streamed requests (the seq sweep:
  one, at a context of S) between the last first token and the first last token.

Each curve's exponent is the log-log slope over the sweep's points; its arithmetic
exponent is the slope of the roofline time (FLOPs / GEMM rate + bytes / copy rate,
both measured here) or of the byte count (memory, sync). One line per curve,

    scaling curve=… x=… metric=… exponent=… arithmetic=… verdict=ok|above

and with ``--out`` a ``result.json`` and one log-log plot per sweep (``scaling_<sweep>.png``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaling_model as sm  # type: ignore[import-not-found]  # noqa: E402

sys.path.pop(0)

# sweep -> (x name, {mode: x values}, Shape fields that stay fixed)
SWEEPS: dict[str, tuple[str, dict[str, list[int]], dict[str, int]]] = {
    "hidden": ("hidden", {"full": [128, 256, 512, 1024], "quick": [64, 128, 256],
                          "smoke": [32, 64]}, {"experts": 8, "topk": 2}),
    "experts": ("experts", {"full": [4, 8, 16, 32, 64], "quick": [4, 8, 16],
                            "smoke": [4, 8]}, {"hidden": 256, "topk": 2}),
    "seq": ("seq", {"full": [256, 512, 1024, 2048, 4096, 8192], "quick": [256, 512, 1024],
                    "smoke": [64, 128]}, {"hidden": 128, "experts": 8, "topk": 2}),
    "topk": ("topk", {"full": [2, 4, 8], "quick": [2, 4, 8], "smoke": [2, 4]},
             {"hidden": 256, "experts": 16}),
}  # fmt: skip
SMOKE_HIDDEN = 32  # the smoke points' hidden size where a sweep fixes it
WORK = {"full": (4, 256, 128), "quick": (4, 256, 128), "smoke": (2, 64, 32)}
"""mode -> (sequences per step, tokens per sequence, engine prompt tokens), model sweeps."""
DECODE = {"full": (4, 48), "quick": (4, 32), "smoke": (2, 8)}
"""mode -> (concurrent requests, new tokens each)."""


# ---- memory ----------------------------------------------------------------------------


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release() -> None:
    """Freed memory leaves the resident set: collect, then trim glibc's heap."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


# ---- trainer ---------------------------------------------------------------------------


def _config(shape: sm.Shape, max_seq: int) -> Any:
    import dataclasses

    from moerl.models.tiny import tiny_config

    return dataclasses.replace(
        tiny_config("qwen3_moe"), num_layers=shape.layers, first_k_dense_replace=0,
        hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim,
        ffn_hidden_size=2 * shape.hidden, vocab_size=shape.vocab,
        max_position_embeddings=max(max_seq, 128), num_experts=shape.experts,
        moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.expert_ffn,
    )  # fmt: skip


def _trajectories(shape: sm.Shape, seqs: int, seq: int) -> list[Any]:
    import numpy as np

    from moerl.common.trajectory import Trajectory

    rng = np.random.default_rng(0)
    prompt = min(32, seq // 4)
    return [
        Trajectory(
            prompt_ids=rng.integers(4, shape.vocab, prompt),
            response_ids=rng.integers(4, shape.vocab, seq - prompt),
            response_logprobs=np.full(seq - prompt, -np.log(shape.vocab)),
            versions=np.zeros(seq - prompt),
            reward=float(i % 2),
            group_id=0,
            index=i,
        )  # fmt: skip
        for i in range(seqs)
    ]


def _trainer(hf_dir: Path, model: Any) -> Any:
    from moerl.algo.config import AlgoConfig
    from moerl.algo.correction_config import TISConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.trainer.trainer import Trainer

    cfg = TrainerConfig(seed=0, lr=1e-5, replay="none", sampling_mask=False)
    return Trainer(model, ParallelConfig(), cfg, AlgoConfig(), TISConfig(), hf_dir=hf_dir)


def _warm_up(root: Path) -> None:
    """One throwaway trainer step, so the first point's memory holds no lazy imports,
    thread pools or one-off buffers."""
    from moerl.models.hf_tiny import save_tiny_checkpoint

    shape = sm.Shape(hidden=SMOKE_HIDDEN, experts=4, topk=2)
    model = _config(shape, 128)
    trainer = _trainer(save_tiny_checkpoint(model, root / "warm-up"), model)
    trainer.step(_trajectories(shape, 2, 64))
    del trainer
    _release()


def _median_time(fn: Any, reps: int) -> float:
    fn()  # warm-up: lazy state (Adam moments), allocator, first-call costs
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train(trainer: Any, trajs: list[Any], reps: int, rss0_kb: int) -> dict[str, float]:
    _release()
    _reset_peak()
    step_s = _median_time(lambda: trainer.step(trajs), reps)
    return {"step_s": step_s, "peak_mb": (_rss_kb("VmHWM") - rss0_kb) / 1024}


def _sync(trainer: Any, model: Any, url: str, reps: int) -> float:
    from moerl.sync.weights import WeightSync

    with WeightSync(trainer.chunks, model, urls=[url], bucket_mb=64) as sync:
        version = iter(range(1, 10**6))
        return _median_time(lambda: sync.push(next(version)), reps)


# ---- engine ----------------------------------------------------------------------------


def _stream(url: str, prompt: list[int], new_tokens: int, out: list[tuple[float, int]]) -> None:
    """One streamed /generate; appends (time, completion tokens so far) per event."""
    import httpx

    body = {
        "input_ids": prompt, "stream": True,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0,
                            "ignore_eos": True, "stream_interval": 1},
    }  # fmt: skip
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
                out.append((time.perf_counter(), tokens))


class Prompts:
    """Fresh random prompts, so no request reuses another's cached prefix."""

    def __init__(self, vocab: int, seed: int = 1) -> None:
        import numpy as np

        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, length: int) -> list[int]:
        return self.rng.integers(4, self.vocab, length).tolist()


def _ttft(url: str, prompts: Prompts, length: int, reps: int) -> float:
    def once() -> float:
        events: list[tuple[float, int]] = []
        start = time.perf_counter()
        _stream(url, prompts(length), 1, events)
        return events[0][0] - start

    once()
    return statistics.median(once() for _ in range(reps))


def _decode(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the concurrent streams while all of them decode."""
    events: list[list[tuple[float, int]]] = [[] for _ in prompts]
    threads = [
        threading.Thread(target=_stream, args=(url, p, new_tokens, e))
        for p, e in zip(prompts, events)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lo, hi = max(e[0][0] for e in events), min(e[-1][0] for e in events)
    if hi <= lo:  # one stream finished before another began: the whole span
        lo, hi = min(e[0][0] for e in events), max(e[-1][0] for e in events)

    def tokens_at(e: list[tuple[float, int]], t: float) -> int:
        return max((n for s, n in e if s <= t), default=0)

    made = sum(tokens_at(e, hi) - tokens_at(e, lo) for e in events)
    return made / (hi - lo)


def _engine(url: str, shape: sm.Shape, prompt: int, batch: int, new_tokens: int,
            reps: int) -> dict[str, float]:  # fmt: skip
    prompts = Prompts(shape.vocab)
    ttft = _ttft(url, prompts, prompt, reps)
    _decode(url, [prompts(prompt) for _ in range(batch)], 4)  # warm-up
    rate = statistics.median(
        _decode(url, [prompts(prompt) for _ in range(batch)], new_tokens) for _ in range(reps)
    )
    return {"ttft_s": ttft, "decode_tok_s": rate}


# ---- sweeps ----------------------------------------------------------------------------

METRICS = {  # metric -> sign (+1 a cost, -1 a rate) and unit
    "step_s": (1, "s"),
    "peak_mb": (1, "MB"),
    "sync_s": (1, "s"),
    "ttft_s": (1, "s"),
    "decode_tok_s": (-1, "tokens/s"),
}


def arithmetic(shape: sm.Shape, work: dict[str, int], rates: dict[str, float]) -> dict[str, float]:
    """Each metric's arithmetic cost at one point (seconds, or MB for memory)."""
    seq, seqs, prompt = work["seq"], work["seqs"], work["prompt"]
    batch, new = work["batch"], work["new_tokens"]
    decode = sm.roofline(*sm.engine_decode(shape, batch, prompt + new // 2), rates)
    return {
        "step_s": sm.roofline(*sm.train_step(shape, seq, seqs), rates),
        "peak_mb": sm.train_memory(shape, seq) / 2**20,
        "sync_s": sm.roofline(0.0, sm.sync_bytes(shape), rates),
        "ttft_s": sm.roofline(*sm.engine_prefill(shape, prompt), rates),
        "decode_tok_s": 1.0 / decode,
    }


class Point:
    """One model served by an engine and held by a trainer, measured at workloads."""

    def __init__(self, shape: sm.Shape, root: Path, max_seq: int) -> None:
        from moerl.engine.process import EngineProcess
        from moerl.models.hf_tiny import save_tiny_checkpoint

        self.shape = shape
        self.model = _config(shape, max_seq)
        hf_dir = save_tiny_checkpoint(
            self.model, root / f"h{shape.hidden}e{shape.experts}k{shape.topk}"
        )
        self.engine = EngineProcess(hf_dir, threads=1)
        _release()
        self.rss0_kb = _rss_kb("VmRSS")  # before the trainer: its whole footprint counts
        self.trainer = _trainer(hf_dir, self.model)

    def measure(self, work: dict[str, int], reps: int, sync: bool) -> dict[str, float]:
        out = _engine(self.engine.url, self.shape, work["prompt"], work["batch"],
                      work["new_tokens"], reps)  # fmt: skip
        trajs = _trajectories(self.shape, work["seqs"], work["seq"])
        out.update(_train(self.trainer, trajs, reps, self.rss0_kb))
        if sync:
            out["sync_s"] = _sync(self.trainer, self.model, self.engine.url, reps)
        return out

    def close(self) -> None:
        self.engine.close()
        del self.trainer
        _release()


def run_sweep(
    name: str, mode: str, reps: int, root: Path, rates: dict[str, float]
) -> dict[str, Any]:
    x_name, values, fixed = SWEEPS[name]
    seqs, seq, prompt = WORK[mode]
    batch, new = DECODE[mode]
    if mode == "smoke" and "hidden" in fixed:
        fixed = {**fixed, "hidden": SMOKE_HIDDEN}
    xs = values[mode]
    points: list[dict[str, Any]] = []
    if name == "seq":  # one model; the workload grows
        shape = sm.Shape(**fixed)
        point = Point(shape, root, max(xs) + new + 1)
        try:
            for x in xs:
                work = dict(seqs=2, seq=x, prompt=x, batch=1, new_tokens=new)
                points.append(
                    _record(name, x, shape, work, point.measure(work, reps, sync=False), rates)
                )
        finally:
            point.close()
    else:
        for x in xs:
            shape = sm.Shape(**{**fixed, x_name: x})
            work = dict(seqs=seqs, seq=seq, prompt=prompt, batch=batch, new_tokens=new)
            point = Point(shape, root, seq + prompt + new)
            try:
                points.append(
                    _record(
                        name, x, shape, work, point.measure(work, reps, sync=name != "topk"), rates
                    )
                )
            finally:
                point.close()
    return {"x": x_name, "points": points, "curves": curves(name, x_name, points)}


def _record(sweep: str, x: int, shape: sm.Shape, work: dict[str, int], measured: dict[str, float],
            rates: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    print(f"scaling sweep={sweep} x={x} params={shape.params()} "
          + " ".join(f"{k}={v:.4g}" for k, v in measured.items()), flush=True)  # fmt: skip
    return {"x": x, "params": shape.params(), "work": work, "measured": measured,
            "model": arithmetic(shape, work, rates)}  # fmt: skip


def curves(sweep: str, x_name: str, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for metric, (sign, unit) in METRICS.items():
        rows = [p for p in points if metric in p["measured"]]
        if len(rows) < 2:
            continue
        xs = [float(p["x"]) for p in rows]
        ys = [float(p["measured"][metric]) for p in rows]
        model = [float(p["model"][metric]) for p in rows]
        measured, expected = sm.exponent(xs, ys), sm.exponent(xs, model)
        out.append({"sweep": sweep, "x_name": x_name, "metric": metric, "unit": unit,
                    "x": xs, "y": ys, "model": model, "exponent": measured,
                    "arithmetic": expected, "verdict": sm.verdict(measured, expected, sign)})  # fmt: skip
    return out


def line(c: dict[str, Any]) -> str:
    return (
        f"scaling curve={c['sweep']}/{c['metric']} x={c['x_name']} metric={c['metric']} "
        f"exponent={c['exponent']:.2f} arithmetic={c['arithmetic']:.2f} verdict={c['verdict']}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 small points per sweep (~3 min)")
    size.add_argument("--smoke", action="store_true", help="2 tiny points per sweep (tests)")
    parser.add_argument("--sweeps", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    parser.add_argument("--reps", type=int, default=None, help="timed repeats (median; 2)")
    parser.add_argument("--out", type=Path, default=None, help="result.json and plots here")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    reps = args.reps or (1 if mode == "smoke" else 2)
    if reps < 1:
        parser.error(f"--reps={reps} must be >= 1")
    import torch

    from moerl.parallel.spawn import single_process_world
    from moerl.parallel.state import destroy

    # every block over 128 KB is mmapped, so a freed tensor leaves the resident set
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    rates = sm.machine_rates(threads=1)
    print(f"scaling mode={mode} gemm_gflops={rates['flops_per_s'] / 1e9:.1f} "
          f"copy_gb_s={rates['bytes_per_s'] / 1e9:.1f}", flush=True)  # fmt: skip
    result: dict[str, Any] = {"mode": mode, "reps": reps, "rates": rates,
                              "tolerance": sm.TOLERANCE, "sweeps": {}}  # fmt: skip
    single_process_world()
    try:
        with tempfile.TemporaryDirectory(prefix="moerl-bench-scaling-") as tmp:
            _warm_up(Path(tmp))
            for name in args.sweeps:
                result["sweeps"][name] = run_sweep(name, mode, reps, Path(tmp), rates)
    finally:
        destroy()
    result["curves"] = [c for s in result["sweeps"].values() for c in s["curves"]]
    for c in result["curves"]:
        print(line(c), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, sweep in result["sweeps"].items():
            if sweep["curves"]:
                sm.plot_curves(name, sweep["x"], sweep["curves"], args.out / f"scaling_{name}.png")
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
