"""Which of ``kernels.batch_invariant``'s ops keep a row's bits on this machine's device.

    python tools/gpu/probe_invariance.py [--device cuda] [--dtypes float32 bfloat16] [--out F]

The ops' promise (a row's result depends on its own inputs alone) rests on how each
backend's kernels behave: a fixed-shape tile product giving a row the same bits
wherever the tile sits and however many tiles the batch holds, reductions that do not
split with size. That was measured on the CPU (MKL); this probe measures it on any
device, op by op, so a failing end-to-end check (tools/bench/true_on_policy.py
``invariant_on`` below 6/6) points at the op to replace. Per op and dtype, one target
row is computed alone, then at several positions inside batches of several sizes; the
op counts as invariant when every placement gives the alone run's bits. The raw torch
products the ops are built from (``torch.bmm`` over a varying number of tiles, ``F.linear``
over a varying number of rows) are probed too, as the diagnosis, and ``linear_wide_n``
asks whether a weight's first 64 outputs keep their bits inside a wider product (fused
weights in the trainer, separate ones in the engine).

Prints one line per (op, dtype): ``probe <op> <dtype> invariant=<bool> differs=<placements>``
and a last line ``probe device=… products=torch|triton invariant=N/M``; ``--out`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script from any directory

BATCHES = (1, 3, 16, 64, 257)
"""Batch sizes (rows, sequences or tiles) the target row is placed in."""

Op = Callable[[torch.Tensor], torch.Tensor]
"""Batch [B, ...] → result [B, ...]; row i's result is what the probe compares."""


def _placements(batch: int) -> list[int]:
    return sorted({0, batch // 2, batch - 1})


def probe(op: Op, row: torch.Tensor, make_other: Callable[[int], torch.Tensor]) -> list[str]:
    """The placements ("batch@position") at which ``op`` gives ``row`` other bits than
    alone (empty: invariant)."""
    alone = op(row[None])[0]
    differs = []
    for batch in BATCHES:
        for pos in _placements(batch):
            rows = make_other(batch)
            rows[pos] = row
            if not torch.equal(op(rows)[pos], alone):
                differs.append(f"{batch}@{pos}")
    return differs


def wide_n(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The output widths N at which ``bi.linear`` gives a column other bits than the
    same weight rows in a narrower product: the trainer multiplies some weights fused
    (megatron-core's QKV, gate and up) where the engine multiplies them apart."""
    from moerl.kernels import batch_invariant as bi

    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(32, 256, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(4096, 256, generator=gen).to(device=device, dtype=dtype)
    narrow = bi.linear(x, w[:64])
    return [
        str(n)
        for n in (128, 192, 1024, 4096)
        if not torch.equal(bi.linear(x, w[:n])[:, :64], narrow)
    ]


def cases(device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Op, torch.Tensor, Any]]:
    from moerl.kernels import batch_invariant as bi

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    hidden, inner, vocab, heads, kv_heads, dim, seq = 256, 512, 4096, 4, 2, 32, 24
    w_in, w_out, w_vocab = rand(inner, hidden), rand(hidden, inner), rand(vocab, hidden)
    norm_w = rand(hidden)
    experts, topk = 8, 2
    gate_up, down = rand(experts, 2 * inner, hidden), rand(experts, hidden, inner)
    tiles_w = rand(inner, hidden)

    def other(*shape: int) -> Callable[[int], torch.Tensor]:
        return lambda batch: rand(batch, *shape)

    def attention(x: torch.Tensor) -> torch.Tensor:  # x [B, S, (h + 2·kv)·D]: causal prefill
        b = x.shape[0]
        q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = q.view(b, seq, heads, dim).transpose(1, 2)
        k = k.view(b, seq, kv_heads, dim).transpose(1, 2)
        v = v.view(b, seq, kv_heads, dim).transpose(1, 2)
        return bi.attention(q, k, v, is_causal=True).transpose(1, 2)

    def decode(x: torch.Tensor) -> torch.Tensor:  # the last query of the sequence alone
        b = x.shape[0]
        q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = q[:, -1:].reshape(b, 1, heads, dim).transpose(1, 2)
        k = k.view(b, seq, kv_heads, dim).transpose(1, 2)
        v = v.view(b, seq, kv_heads, dim).transpose(1, 2)
        return bi.attention(q, k, v).transpose(1, 2)

    def routed(x: torch.Tensor) -> torch.Tensor:  # a row's experts follow from its values
        picks = x[:, :experts].float().topk(topk, dim=-1).indices
        weights = torch.full(picks.shape, 0.5, device=device, dtype=dtype)
        return bi.experts(x, picks, weights, gate_up, down, bi.silu)

    qkv = (heads + 2 * kv_heads) * dim
    return {
        "linear": (lambda x: bi.linear(x, w_in), rand(hidden), other(hidden)),
        "linear_split_k": (
            lambda x: bi.linear(x, w_out, splits=bi.K_SPLITS),
            rand(inner),
            other(inner),
        ),  # fmt: skip
        "lm_head": (lambda x: bi.linear(x, w_vocab), rand(hidden), other(hidden)),
        "rms_norm": (lambda x: bi.rms_norm(x, norm_w), rand(hidden), other(hidden)),
        "log_softmax": (lambda x: bi.log_softmax(x, -1), rand(vocab), other(vocab)),
        "silu": (bi.silu, rand(inner), other(inner)),
        "attention_prefill": (attention, rand(seq, qkv), other(seq, qkv)),
        "attention_decode": (decode, rand(seq, qkv), other(seq, qkv)),
        "experts": (routed, rand(hidden), other(hidden)),
        # the raw products: the number of [ROWS, K] tiles varies; a plain F.linear's rows
        "torch_bmm_tiles": (
            lambda x: bi._tiles(x.reshape(-1, hidden), tiles_w).view(x.shape[0], bi.ROWS, -1),
            rand(bi.ROWS, hidden),
            other(bi.ROWS, hidden),
        ),  # fmt: skip
        "torch_linear": (lambda x: F.linear(x, w_in), rand(hidden), other(hidden)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="auto", help="auto (default): the GPU if any, cuda, cpu"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from moerl import device as devices

    device = devices.resolve(args.device)
    found: dict[str, Any] = {"ops": {}}
    found["device"] = devices.name() if device.type == "cuda" else "cpu"
    from moerl.kernels.dispatch import use_triton

    # who runs the ops' products here (kernels/tile_product.py): torch, or the Triton kernel
    probe_tensor = torch.zeros(1, device=device)
    found["products"] = "triton" if use_triton(probe_tensor) else "torch"
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for op, (fn, row, make_other) in cases(device, dtype).items():
            with torch.no_grad():
                differs = probe(fn, row, make_other)
            found["ops"][f"{op}/{name}"] = differs
            print(f"probe {op} {name} invariant={not differs} differs={','.join(differs) or '-'}",
                  flush=True)  # fmt: skip
        with torch.no_grad():
            widths = wide_n(device, dtype)
        found["ops"][f"linear_wide_n/{name}"] = widths
        print(f"probe linear_wide_n {name} invariant={not widths} differs={','.join(widths) or '-'}",
              flush=True)  # fmt: skip
    ours = {k: v for k, v in found["ops"].items() if not k.startswith("torch_")}
    found["invariant"] = sum(not v for v in ours.values())
    found["total"] = len(ours)
    print(f"probe device={found['device']} products={found['products']} "
          f"invariant={found['invariant']}/{found['total']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    main()
