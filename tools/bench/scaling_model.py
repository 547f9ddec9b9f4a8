"""What the cost curves of ``scaling.py`` should be: FLOP and byte counts from the config,
a roofline time from them, log-log fits and the plots.

# h hidden, a query heads, g kv groups, d head dim, f expert ffn, E experts, K top-k,
# V vocab, L layers, S tokens of one sequence, B sequences

Every layer is MoE (no dense layers), attention is GQA, the output head is untied. The
arithmetic cost of a curve is the roofline time ``flops / F + bytes / W`` with F (GEMM
FLOP/s) and W (copy bytes/s) measured on this machine's thread; its exponent is the
slope of log cost over the sweep's own points, so it says how the work grows at the
shapes actually measured (a term that is small at these shapes does not set it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

F32 = 4  # bytes; trainer and engine both run fp32 here
TOLERANCE = 0.15
"""A measured exponent more than this above the arithmetic one reads ``above``: the
noise of a few points timed on shared cores is about ±0.1."""


@dataclass(frozen=True)
class Shape:
    """One model of a sweep."""

    hidden: int
    experts: int
    topk: int
    layers: int = 2
    heads: int = 4
    groups: int = 2
    vocab: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def expert_ffn(self) -> int:
        return self.hidden // 2

    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.groups) * d + self.heads * d * h

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ffn  # gate, up, down

    def params(self) -> int:
        """Every parameter (norms included), the bytes a weight sync sends / 4."""
        h = self.hidden
        layer = self.attention_params() + h * self.experts + self.experts * self.expert_params()
        norms = self.layers * (2 * h + 2 * self.head_dim) + h
        return self.layers * layer + 2 * self.vocab * h + norms

    def active_matmul_params(self) -> int:
        """Weights one token multiplies by: attention, router, K experts, output head."""
        layer = (
            self.attention_params() + self.hidden * self.experts + self.topk * self.expert_params()
        )
        return self.layers * layer + self.vocab * self.hidden


def forward_flops(shape: Shape, seq: int) -> float:
    """One sequence of ``seq`` tokens: 2 per weight per token, plus QK^T and PV over the
    causal half of the S x S scores (fused SDPA in trainer and engine skips the rest)."""
    attention = 4 * seq * seq * shape.heads * shape.head_dim * shape.layers
    return 2 * seq * shape.active_matmul_params() + attention / 2


def train_step(shape: Shape, seq: int, seqs: int) -> tuple[float, float]:
    """(flops, bytes) of ``Trainer.step`` on ``seqs`` sequences of ``seq`` tokens: π_old's
    forward, forward + backward (3 forwards), then Adam: ~48 bytes per parameter (the
    read-modify-write of weight, grad and two moments, the grad norm, zeroing, and the
    forward/backward weight reads)."""
    flops = 4 * seqs * forward_flops(shape, seq)
    return flops, 48.0 * shape.params()


def train_memory(shape: Shape, seq: int) -> float:
    """Resident bytes at the step's peak: weight, grad buffer and two Adam moments (16 bytes
    per parameter), plus one micro-batch's (one sequence's) saved activations: per layer
    ~12h for attention and norms, a for fused attention's log-sum-exp (no S x S scores),
    K(3f + 2h) for the routed experts' inputs and outputs, then 3V for the logits, their
    log-softmax and grad."""
    h = shape.hidden
    per_token_layer = 12 * h + shape.heads + shape.topk * (3 * shape.expert_ffn + 2 * h)
    activations = seq * (shape.layers * per_token_layer + 3 * shape.vocab) * F32
    return 16.0 * shape.params() + activations


def sync_bytes(shape: Shape) -> float:
    return float(F32 * shape.params())


def engine_prefill(shape: Shape, prompt: int) -> tuple[float, float]:
    """(flops, bytes) of a lone request's first token: the prompt's causal forward and a
    read of every weight it touches."""
    touched = min(shape.experts, prompt * shape.topk)
    weights = shape.params() - shape.layers * (shape.experts - touched) * shape.expert_params()
    return forward_flops(shape, prompt), float(F32 * weights)


def engine_decode(shape: Shape, batch: int, context: int) -> tuple[float, float]:
    """(flops, bytes) per generated token of a decode step of ``batch`` requests at
    ``context`` tokens: weights read once per step (the experts the batch's tokens touch),
    each request's KV read once."""
    touched = min(shape.experts, batch * shape.topk)
    weights = shape.params() - shape.layers * (shape.experts - touched) * shape.expert_params()
    kv = 2 * shape.groups * shape.head_dim * shape.layers * context
    attention = 4 * context * shape.heads * shape.head_dim * shape.layers
    flops = 2 * shape.active_matmul_params() + attention
    return float(flops), F32 * (weights / batch + kv)


# ---- the machine ----------------------------------------------------------------------


def machine_rates(threads: int = 1) -> dict[str, float]:
    """GEMM FLOP/s and copy bytes/s of this machine at ``threads`` torch threads (best of 5)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)

        def best(fn: Any) -> float:
            fn()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        gemm = 2 * 512**3 / best(lambda: torch.mm(a, b))
        copy = 2 * src.numel() * F32 / best(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(before)
    return {"flops_per_s": gemm, "bytes_per_s": copy}


def roofline(flops: float, nbytes: float, rates: dict[str, float]) -> float:
    return flops / rates["flops_per_s"] + nbytes / rates["bytes_per_s"]


# ---- fits ------------------------------------------------------------------------------


def exponent(xs: list[float], ys: list[float]) -> float:
    """The slope of log y on log x (least squares)."""
    import numpy as np

    if len(xs) < 2 or any(v <= 0 for v in (*xs, *ys)):
        return math.nan
    slope, _ = np.polyfit(np.log(xs), np.log(ys), 1)
    return float(slope)


def verdict(measured: float, arithmetic: float, sign: int = 1) -> str:
    """'above' when the cost grows faster than the arithmetic by more than TOLERANCE
    (``sign=-1`` for a rate such as tokens/s, whose cost is its inverse)."""
    if math.isnan(measured) or math.isnan(arithmetic):
        return "n/a"
    return "above" if sign * (measured - arithmetic) > TOLERANCE else "ok"


# ---- plots -----------------------------------------------------------------------------


def plot_curves(sweep: str, x_name: str, curves: list[dict[str, Any]], path: Path) -> Path:
    """One log-log panel per metric: measured points and the arithmetic curve scaled to
    pass through the measured geometric mean."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(3.2 * len(curves), 3.0), layout="constrained")
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, c in zip(axes, curves):
        xs, ys, model = (np.asarray(c[k], dtype=float) for k in ("x", "y", "model"))
        ax.loglog(xs, ys, "o-", color="tab:blue", label=f"measured ({c['exponent']:.2f})")
        scale = math.exp(np.mean(np.log(ys)) - np.mean(np.log(model)))
        ax.loglog(xs, model * scale, "--", color="tab:gray",
                  label=f"arithmetic ({c['arithmetic']:.2f})")  # fmt: skip
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(x_name)
        ax.set_title(c["metric"], fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"cost vs {x_name} (log-log; slopes in the legend)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, format="png")
    return path


# ---- what the measured exponents mean --------------------------------------------------

REASONS: dict[str, str] = {
    "hidden/step_s": "below: at h ≤ 256 per-op overhead (megatron's per-expert loop, "
    "Python) dominates; from 512 to 1024 the step grows ~h^1.9, the GEMMs' h^2",
    "hidden/peak_mb": "weights, grads and Adam moments, 16 bytes per parameter ∝ h^2, "
    "plus activations ∝ h; the fixed overhead flattens the small end",
    "hidden/sync_s": "bytes ∝ h^2; below at the small end where the per-push HTTP and "
    "bucket round trips dominate",
    "hidden/ttft_s": "a 128-token prefill of these models is per-request overhead "
    "(HTTP, scheduler, tokens streamed); the compute never dominates at these sizes",
    "hidden/decode_tok_s": "flat: 4 concurrent requests of these models are bound by the "
    "per-step overhead of the engine's decode loop, not by weights read",
    "experts/step_s": "above: megatron-core's SequentialMLP runs every local expert in a "
    "Python loop (forward and backward), and Adam steps each expert's 3 tensors one by "
    "one, so per-expert overhead grows ∝ E while the FLOPs stay flat (top-2). moerl sets "
    "moe_grouped_gemm=False because megatron's GroupedMLP needs the grouped_gemm CUDA "
    "package; with transformer-engine (GPU) TEGroupedMLP runs one grouped GEMM",
    "experts/peak_mb": "expert weights and their Adam state ∝ E",
    "experts/sync_s": "bytes: expert weights ∝ E",
    "experts/ttft_s": "prefill touches every expert's weights once (reads ∝ E)",
    "experts/decode_tok_s": "above (rate falls faster than the bytes say): the engine runs "
    "transformers' Qwen3-MoE block, which loops in Python over the experts hit in each "
    "step, and the batch's 8 routed slots hit more distinct experts as E grows; "
    "moerl/engine's model runner is being rewritten elsewhere and was left alone",
    "seq/step_s": "attention's S^2 half and the linear part: the fused SDPA kernel "
    "(moerl/models/local_attention.py) runs ~1.1-1.4 over this range; megatron-core's "
    "unfused DotProductAttention gave 1.8 and 22.5 s at 4K (vs 5.8 s now)",
    "seq/peak_mb": "one micro-batch's activations ∝ S with fused attention (the unfused "
    "path kept a·S^2 scores: 1409 MB at 4K vs 145 MB now)",
    "seq/ttft_s": "prefill: linear part plus causal S^2 attention; per-request overhead "
    "hides the small end",
    "seq/decode_tok_s": "one request at context S: the step's overhead dominates the "
    "KV read at this model size",
    "topk/step_s": "expert FLOPs ∝ K, but the per-expert loop's fixed overhead (16 "
    "experts) dominates",
    "topk/peak_mb": "the routed experts' saved activations ∝ K, small beside the weights",
    "topk/ttft_s": "per-request overhead; noise on shared cores (the first point)",
    "topk/decode_tok_s": "noise-dominated: per-step overhead, the K experts' reads are small",
}
"""``sweep/metric`` -> why its exponent is what it is (REPORT.md's cost curve table)."""
