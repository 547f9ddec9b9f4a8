"""moerl.kernels against the torch code they replace, side by side, forward + backward.

    python tools/bench/kernel_speed.py [--quick] [--device cpu|cuda] [--out DIR]

Prints one line per kernel and size,

    kernel=… size=… kernel_ms=… torch_ms=… speedup=… kernel_peak_mb=… torch_peak_mb=… mem_ratio=…

and writes the rows to ``DIR/result.json``. Times are medians over repeats after one
warm-up (Triton compiles there). Peak MB is the CUDA allocator's peak during one
forward + backward minus what was allocated before it (the inputs), i.e. what the op
itself needs. speedup = torch_ms / kernel_ms; mem_ratio = torch_peak_mb / kernel_peak_mb.
A side that runs out of memory reads ``oom``.

On ``--device cpu`` the Triton kernels do not run (they need CUDA; the interpreter is for
tests, not timing): the kernel and peak columns print ``nan`` and ``torch_ms`` times the
torch path alone, so the script stays runnable and tested everywhere.

Cases come from builders ``(quick, device) -> [(name, size, run_kernel, run_torch)]``:
``logprob_cases`` here, and ``cases`` from ``kernels_cases_lora.py`` beside this file when
it exists. Each builder's ``run_*`` allocate their inputs lazily on first call, so only
the running case's tensors are alive.

Targets (issue 8, fused_logprobs at 32768 tokens × 152064 vocab × 4096 hidden, bf16):
peak ≤ 1/8 of torch (mem_ratio ≥ 8) and time ≤ torch (speedup ≥ 1).
"""

# T tokens, V vocabulary, H hidden

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moerl import device as moerl_device

Case = tuple[str, str, Callable[[], None], Callable[[], None]]
TARGETS = {"mem_ratio": 8.0, "speedup": 1.0}


def _lazy(make: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """Build the inputs on first use and keep them for the repeats."""
    held: dict[str, Any] = {}

    def get() -> dict[str, Any]:
        if not held:
            held.update(make())
        return held

    return get


def _fwd_bwd(logprob_T: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    for leaf in leaves:
        leaf.grad = None
    logprob_T.sum().backward()


def logprob_cases(quick: bool, device: str) -> list[Case]:
    """fused_logprobs vs the trainer's path (output layer matmul to bf16 logits, then
    token_logprobs), and logprobs_from_logits vs token_logprobs on the same logits."""
    from moerl.kernels.dispatch import backend
    from moerl.kernels.logprob import fused_logprobs, logprobs_from_logits
    from moerl.trainer.logprobs import token_logprobs

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        fused = [(256, 4096, 256)] if quick else [(4096, 32768, 2048), (8192, 152064, 4096),
                                                  (32768, 152064, 4096)]  # fmt: skip
        logits = [(256, 4096)] if quick else [(8192, 152064), (32768, 152064)]
    else:
        fused = [(64, 512, 64)] if quick else [(1024, 32768, 512)]
        logits = [(64, 512)] if quick else [(1024, 32768)]

    def hidden_inputs(tokens: int, vocab: int, hidden: int) -> Callable[[], dict[str, Any]]:
        def make() -> dict[str, Any]:
            gen = torch.Generator(device).manual_seed(0)
            scale = 2 / hidden**0.5
            new: dict[str, Any] = dict(device=device, generator=gen)
            return dict(
                hidden=torch.randn(tokens, hidden, **new).to(dtype).requires_grad_(True),
                weight=(torch.randn(vocab, hidden, **new) * scale).to(dtype).requires_grad_(True),
                labels=torch.randint(0, vocab, (tokens,), **new),
                temp=torch.full((tokens,), 0.7, device=device),
            )

        return _lazy(make)

    def logits_inputs(tokens: int, vocab: int) -> Callable[[], dict[str, Any]]:
        def make() -> dict[str, Any]:
            gen = torch.Generator(device).manual_seed(0)
            new: dict[str, Any] = dict(device=device, generator=gen)
            return dict(
                logits=(torch.randn(tokens, vocab, **new) * 2).to(dtype).requires_grad_(True),
                labels=torch.randint(0, vocab, (tokens,), **new),
                temp=torch.full((tokens,), 0.7, device=device),
            )

        return _lazy(make)

    cases: list[Case] = []
    tag = str(dtype).removeprefix("torch.")
    for tokens, vocab, hidden in fused:
        get = hidden_inputs(tokens, vocab, hidden)

        def kernel(get: Callable[[], dict[str, Any]] = get) -> None:
            x = get()
            with backend("triton"):
                lp, _ = fused_logprobs(x["hidden"], x["weight"], x["labels"], x["temp"])
            _fwd_bwd(lp, [x["hidden"], x["weight"]])

        def torch_path(get: Callable[[], dict[str, Any]] = get) -> None:
            x = get()
            lp = token_logprobs(x["hidden"] @ x["weight"].T, x["labels"], x["temp"])
            _fwd_bwd(lp, [x["hidden"], x["weight"]])

        cases.append(("fused_logprobs", f"{tokens}x{vocab}x{hidden}:{tag}", kernel, torch_path))
    for tokens, vocab in logits:
        get = logits_inputs(tokens, vocab)

        def kernel_l(get: Callable[[], dict[str, Any]] = get) -> None:
            x = get()
            with backend("triton"):
                lp, _ = logprobs_from_logits(x["logits"], x["labels"], x["temp"])
            _fwd_bwd(lp, [x["logits"]])

        def torch_l(get: Callable[[], dict[str, Any]] = get) -> None:
            x = get()
            _fwd_bwd(token_logprobs(x["logits"], x["labels"], x["temp"]), [x["logits"]])

        cases.append(("logprobs_from_logits", f"{tokens}x{vocab}:{tag}", kernel_l, torch_l))
    return cases


def _extra_builders() -> list[Callable[[bool, str], list[Case]]]:
    """Case builders other kernels ship beside this script."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import kernels_cases_lora  # type: ignore[import-not-found]
    except ImportError:
        return []
    finally:
        sys.path.pop(0)
    return [kernels_cases_lora.cases]


def _cpu_measure(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), math.nan


def _side(fn: Callable[[], None], device: str, reps: int) -> tuple[float | str, float | str]:
    try:
        if device == "cuda":
            return moerl_device.cuda_time_and_peak(fn, reps)
        return _cpu_measure(fn, reps)
    except torch.OutOfMemoryError:
        return "oom", "oom"
    finally:
        moerl_device.empty_cache()


def _ratio(num: float | str, den: float | str) -> float:
    if isinstance(num, str) or isinstance(den, str) or not den or math.isnan(den):
        return math.nan
    return num / den


def _fmt(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.2f}"


def run_case(case: Case, device: str, reps: int) -> dict[str, Any]:
    name, size, run_kernel, run_torch = case
    size = "_".join(size.split())  # one whitespace-free field per key on the printed line
    kernel_ms, kernel_mb = _side(run_kernel, device, reps) if device == "cuda" else (math.nan,) * 2
    torch_ms, torch_mb = _side(run_torch, device, reps)
    return dict(kernel=name, size=size, kernel_ms=kernel_ms, torch_ms=torch_ms,
                speedup=_ratio(torch_ms, kernel_ms), kernel_peak_mb=kernel_mb,
                torch_peak_mb=torch_mb, mem_ratio=_ratio(torch_mb, kernel_mb))  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from moerl.device import has_cuda

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two repeats")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_kernels"))
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if has_cuda() else "cpu")
    if device == "cuda" and not has_cuda():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    reps = 2 if args.quick else 5
    if device == "cpu":
        print("# cpu: Triton kernels need CUDA, so kernel and peak columns are n/a (nan);")
        print("# torch_ms times the torch path alone")
    rows = []
    for build in [logprob_cases, *_extra_builders()]:
        cases = build(args.quick, device)
        while cases:  # pop, so a finished case's inputs are freed before the next
            row = run_case(cases.pop(0), device, reps)
            print(" ".join(f"{key}={_fmt(value)}" for key, value in row.items()), flush=True)
            rows.append(row)
    print(f"# targets at the full fused_logprobs size: {TARGETS}")
    args.out.mkdir(parents=True, exist_ok=True)
    clean = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
             for r in rows]  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(dict(device=device, rows=clean), indent=2))
    return rows


if __name__ == "__main__":
    main()
