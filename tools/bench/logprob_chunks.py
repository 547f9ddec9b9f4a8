"""fused_logprobs' chunk shape against time and memory, beside the torch path, on one GPU.

    python tools/bench/logprob_chunks.py [--shape 32768x152064x4096] [--dtype bf16]
                                         [--chunks 4096x8192 2048x16384 ...] [--reps 5]

For each ``chunk_tokens x chunk_vocab`` (moerl/kernels/logprob.py's ``fused_logprobs``
says what they bound) and for the trainer's torch path (the output-layer matmul to logits,
then ``token_logprobs``), one line

    path=… chunks=… fwd_ms=… fwd_peak_mb=… fwd_bwd_ms=… fwd_bwd_peak_mb=…

``fwd`` runs under ``torch.no_grad`` (π_old and reference logprobs), ``fwd_bwd`` is a
training step's forward and backward into hidden and weight (times are medians after a
warm-up; peak is what the call allocates beyond its inputs, as tools/bench/kernel_speed.py
measures). Pick the fastest chunk shape whose peak fits; the default is the first row.

Needs CUDA: on the CPU the Triton kernels run only in the interpreter (``--dry-run``,
tiny shape, checks the script runs; its times mean nothing).
"""

# T tokens, V vocabulary, H hidden

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _measure(fn: Callable[[], None], reps: int, cuda: bool) -> tuple[float, float]:
    import torch

    from moerl.device import cuda_time_and_peak, empty_cache

    try:
        if cuda:
            return cuda_time_and_peak(fn, reps)
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), float("nan")
    except torch.OutOfMemoryError:
        return float("nan"), float("nan")
    finally:
        empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="32768x152064x4096", help="TxVxH")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--chunks", nargs="+", default=["4096x8192", "8192x8192", "4096x16384", "16384x4096"]
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shape")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shape, args.chunks, args.reps, args.dtype = "24x150x16", ["8x64", "16x32"], 1, "fp32"

    import torch

    from moerl.device import has_cuda
    from moerl.kernels.dispatch import backend
    from moerl.kernels.logprob import fused_logprobs
    from moerl.trainer.logprobs import token_logprobs

    cuda = has_cuda() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device: this bench measures the GPU kernels (--dry-run on CPU)")
    dev = "cuda" if cuda else "cpu"
    tokens, vocab, hidden = (int(x) for x in args.shape.split("x"))
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(dev).manual_seed(0)
    hidden_TH = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype)
    weight_VH = (torch.randn(vocab, hidden, device=dev, generator=gen) * 2 / hidden**0.5).to(dtype)
    labels_T = torch.randint(0, vocab, (tokens,), device=dev, generator=gen)
    temp_T = torch.full((tokens,), 0.7, device=dev)

    def runs(logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):  # type: ignore[no-untyped-def]
        def fwd() -> None:
            with torch.no_grad():
                logprobs(hidden_TH, weight_VH)

        def fwd_bwd() -> None:
            h = hidden_TH.detach().requires_grad_(True)
            w = weight_VH.detach().requires_grad_(True)
            logprobs(h, w).sum().backward()

        return fwd, fwd_bwd

    paths: list[tuple[str, str, Callable]] = [
        ("torch", "-", lambda h, w: token_logprobs(h @ w.T, labels_T, temp_T))
    ]
    for chunk in args.chunks:
        ct, cv = (int(x) for x in chunk.split("x"))

        def fused(h, w, ct=ct, cv=cv):  # type: ignore[no-untyped-def]
            with backend("triton"):
                return fused_logprobs(h, w, labels_T, temp_T, chunk_tokens=ct, chunk_vocab=cv)[0]

        paths.append(("fused", chunk, fused))
    rows = []
    for name, chunk, fn in paths:
        fwd, fwd_bwd = runs(fn)
        fwd_ms, fwd_mb = _measure(fwd, args.reps, cuda)
        all_ms, all_mb = _measure(fwd_bwd, args.reps, cuda)
        row = dict(path=name, chunks=chunk, fwd_ms=fwd_ms, fwd_peak_mb=fwd_mb,
                   fwd_bwd_ms=all_ms, fwd_bwd_peak_mb=all_mb)  # fmt: skip
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)  # fmt: skip
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
