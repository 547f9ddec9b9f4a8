"""Benchmark cases for the LoRA grouped matmul and the routing-replay gather.

    python tools/bench/kernels_cases_lora.py   # CPU smoke test: the twins at tiny sizes

``tools/bench/kernel_speed.py`` imports ``cases`` and times each pair. A case is
``(kernel, size label, run_kernel, run_torch)``; each callable runs the forward and the
backward once (gradients through ``torch.autograd.grad``, so nothing accumulates between
repeats) under its backend, and does not synchronise the device.

Sizes on a GPU (bf16):

- ``lora_gmm``: 64 local experts, rank 16, I = O = hidden 2048 or 4096, 8K or 32K tokens
  each routed to 8 distinct experts uniformly at random (64K or 256K expert rows). The
  twin is the per-expert loop SequentialMLP runs today; the target is the kernel ≥ 3×
  faster (``TARGET_SPEEDUP``).
- ``replay_gather``: 32K tokens × 256 experts × top-8, renormalised and scaled (a
  DeepSeek-V3 router), on fp32 scores (``moe_router_dtype=fp32``) and on bf16 ones.

``quick`` (CPU): tiny sizes of both, fp32.
"""

# T tokens, N expert rows (T·K), E experts, I in, O out, r rank, K top-k

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moerl.kernels.dispatch import backend
from moerl.kernels.lora_gmm import lora_grouped
from moerl.kernels.replay_gather import replay_gather

Case = tuple[str, str, Callable[[], Any], Callable[[], Any]]
TARGET_SPEEDUP = {"lora_gmm": 3.0}  # kernel vs twin, at the GPU sizes


def _routes(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] distinct experts per token, uniformly at random."""
    return torch.argsort(torch.rand(tokens, experts, generator=gen), dim=1)[:, :topk]


def _label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _lora_case(
    experts: int, hidden: int, rank: int, tokens: int, topk: int, device: str, dtype: torch.dtype
) -> Case:
    gen = torch.Generator().manual_seed(0)
    counts_E = torch.bincount(_routes(tokens, experts, topk, gen).flatten(), minlength=experts)
    rows = int(counts_E.sum())
    x_NI = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_(True)
    a_ErI = (torch.randn(experts, rank, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    b_EOr = (torch.randn(experts, hidden, rank, generator=gen) / rank**0.5).to(device, dtype)
    a_ErI.requires_grad_(True)
    b_EOr.requires_grad_(True)
    g_NO = torch.randn(rows, hidden, generator=gen).to(device, dtype)

    def run(name: str) -> Callable[[], Any]:
        def step() -> Any:
            with backend(name):
                y_NO = lora_grouped(x_NI, a_ErI, b_EOr, counts_E, 2.0)
            return torch.autograd.grad(y_NO, (x_NI, a_ErI, b_EOr), g_NO)

        return step

    label = (
        f"E{experts} h{hidden} r{rank} {_label(tokens)} tok×top{topk} "
        f"{str(dtype).removeprefix('torch.')}"
    )
    return "lora_gmm", label, run("triton"), run("torch")


def _replay_case(tokens: int, experts: int, topk: int, device: str, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(0)
    scores_TE = torch.rand(tokens, experts, generator=gen).to(device, dtype).requires_grad_(True)
    idx_TK = _routes(tokens, experts, topk, gen).to(device)
    g_TK = torch.randn(tokens, topk, generator=gen).to(device, dtype)

    def run(name: str) -> Callable[[], Any]:
        def step() -> Any:
            with backend(name):
                probs_TK = replay_gather(scores_TE, idx_TK, normalize=True, scale=2.5)
            return torch.autograd.grad(probs_TK, scores_TE, g_TK)

        return step

    label = f"T{_label(tokens)} E{experts} K{topk} {str(dtype).removeprefix('torch.')}"
    return "replay_gather", label, run("triton"), run("torch")


def cases(quick: bool, device: str) -> list[Case]:
    """The benchmark cases for ``device`` ('cuda' or 'cpu'); ``quick``: tiny sizes."""
    if quick:
        return [
            _lora_case(8, 64, 8, 64, 2, device, torch.float32),
            _replay_case(256, 16, 4, device, torch.float32),
        ]
    return [
        _lora_case(64, 2048, 16, 8192, 8, device, torch.bfloat16),
        _lora_case(64, 4096, 16, 8192, 8, device, torch.bfloat16),
        _lora_case(64, 4096, 16, 32768, 8, device, torch.bfloat16),
        _replay_case(32768, 256, 8, device, torch.float32),
        _replay_case(32768, 256, 8, device, torch.bfloat16),
    ]


def main() -> None:
    """Time the twins of the quick cases on the CPU (no Triton needed)."""
    for kernel, size, _, run_torch in cases(quick=True, device="cpu"):
        run_torch()  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run_torch()
            times.append(time.perf_counter() - start)
        print(f"kernel={kernel} size={size!r} torch_ms={1e3 * statistics.median(times):.3f}")


if __name__ == "__main__":
    main()
