"""Decode steps replayed as CUDA graphs (SGLang's ``--disable-cuda-graph``,
``--cuda-graph-max-bs``).

On a GPU a small model's decode step is bounded by what the CPU issues: one transformers
forward of the tiny MoE is about 2600 aten ops and 450 kernel launches (measured with
``tools/gpu/profile_engine.py``), where the GPU's own work takes a fraction of that time.
SGLang captures the decode forward once per batch size and replays it; so does this
module, for the transformers model the engine runs.

A graph has fixed shapes and addresses, so a captured step differs from
``ModelRunner.decode``'s eager forward in four ways:

- the batch is padded to the next captured size ``bs``: pad rows decode token 0 at
  position 0 of the unused slots B..bs-1 (what they write there is never read: a slot's
  positions are written by its owner before they are read);
- attention reads every position of the pool's capacity, masked beyond each row's own
  (the eager forward reads up to the longest row);
- the tokens and positions are copied into one static buffer, and the logits and the
  routes are read from the captured outputs;
- MoE experts run an implementation a graph can hold (``graph_experts``): transformers'
  per-expert loop asks the host which experts got tokens, and torch's grouped GEMM
  copies its offsets to the host for any dtype but bfloat16 (seen on an H200: "Cannot
  copy between CPU and CUDA tensors during CUDA graph capture"). So bfloat16 takes
  ``grouped_mm`` and other dtypes ``batched_mm``, which gathers each (token, expert)
  pair's weights: B·K copies of one expert's weights per step, fine for decode batches
  of small models; a capture that runs out of memory turns graphs off (below). Prefill
  keeps the model's own implementation.

A graph holds the pool's tensors and the weights by address. Graphs are dropped when the
pool grows or is replaced (the key is the pool's identity and its reallocation count)
and when the weights are released (``clear``); pushed weights are copied in place, which
a replay sees. Graphs are used only when the running requests hold slots 0..B-1 and no
other, carry no LoRA adapter, and B is at most the largest size; any other step runs the
eager forward. A capture that fails (a model whose forward waits on the host) turns
graphs off for the engine's life with one warning, and the step runs eagerly.

``capture`` is what turns a step function into a replayable one: ``moerl.device.graphed``
on CUDA. Tests on the CPU pass ``run_eagerly``, which runs the same static-shaped step
every time, so the padding, masking and slot rules are checked without a GPU.
"""

# B rows, bs captured size, T pool capacity, V vocab, L layers, K top-k

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moerl.engine.core.kv_pool import KVPool, Plan

if TYPE_CHECKING:
    from moerl.engine.core.model_runner import ModelRunner

log = logging.getLogger(__name__)

# SGLang's capture sizes, coarser as they grow; a run's list ends at its max size
BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DEFAULT_MAX_BS = 256

Outputs = tuple[torch.Tensor, dict[int, torch.Tensor]]  # logits [bs, 1, V], routes by layer
Capture = Callable[[Callable[[], Outputs]], Callable[[], Outputs]]


def run_eagerly(fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
    """The capture of a device without graphs: every call runs ``fn`` again."""
    return fn


def graph_experts(dtype: torch.dtype) -> str:
    """The transformers experts implementation a captured decode step uses."""
    return "grouped_mm" if dtype == torch.bfloat16 else "batched_mm"


def batch_sizes(max_bs: int) -> list[int]:
    """The sizes captured for batches of up to ``max_bs`` rows (``max_bs`` the last)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs {max_bs}: must be at least 1")
    return [b for b in BATCH_SIZES if b < max_bs] + [max_bs]


class _StaticPlan(Plan):
    """A decode plan over slots 0..bs-1 reading the pool's whole capacity, whose positions
    (and so the write positions and the mask) come from a buffer filled before each call."""

    def __init__(self, bs: int, capacity: int, positions: torch.Tensor) -> None:
        super().__init__(list(range(bs)), [capacity - 1] * bs, [1] * bs, positions.device)
        self.static_positions = positions  # [bs, 1]
        self.pos_idx = positions.view(bs)

    def positions(self) -> torch.Tensor:
        return self.static_positions


class _Step:
    """One captured size: its input buffer (row 0 tokens, row 1 positions), its plan and
    its call. A graph reads the buffer and the plan's index tensors by address, so the
    step holds them for as long as the graph lives."""

    def __init__(self, inputs: torch.Tensor, plan: Plan, call: Callable[[], Outputs]) -> None:
        self.inputs = inputs  # [2, bs] int64, on the model's device
        self.plan = plan
        self.call = call


class DecodeGraphs:
    """See the module docstring. Used by the scheduler thread only (through the runner)."""

    def __init__(self, runner: ModelRunner, max_bs: int, capture: Capture) -> None:
        self.runner = runner
        self.sizes = batch_sizes(max_bs)
        self.capture = capture
        self.experts = graph_experts(runner.dtype)
        self.steps: dict[int, _Step] = {}
        self.key: tuple[int, int] | None = None
        self.disabled: str | None = None
        """Why graphs are off for good (a capture failed), else None."""
        self.captures = 0
        self.replays = 0

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def clear(self) -> None:
        """Drop every graph (the weights they read are about to move)."""
        self.steps.clear()
        self.key = None

    def size(self, batch: int) -> int:
        """The captured size a batch of ``batch`` rows is padded to."""
        return next(s for s in self.sizes if s >= batch)

    def usable(self, pool: KVPool, slots: list[int], adapters: list[str | None] | None) -> bool:
        """Whether this decode step may run as a graph (see the module docstring)."""
        batch = len(slots)
        return (
            self.disabled is None
            and self.runner.lora is None
            and not any(adapters or [])
            and 0 < batch <= self.max_bs
            and self.size(batch) <= pool.max_slots
            and pool.used == batch
            and slots == list(range(batch))
            and len(pool.keys) == pool.num_layers
            and not pool.shared  # graphs read the pool's own tensors only
        )

    def decode(
        self, pool: KVPool, starts: list[int], tokens: list[int]
    ) -> tuple[torch.Tensor, np.ndarray] | None:
        """Logits [B, V] (float32, a copy) and routes [B, L, K] of one decode step of rows
        0..B-1 at positions ``starts``, or None when the capture failed just now (graphs
        are then off: run the eager forward). The caller sets the slots' lengths."""
        batch = len(tokens)
        bs = self.size(batch)
        pool.reserve(bs, max(starts) + 1)  # slots for the pad rows, room for the longest
        key = (id(pool), pool.reallocations)
        if key != self.key:  # a new or regrown pool: the graphs read the old tensors
            self.clear()
            self.key = key
        host = torch.zeros(2, bs, dtype=torch.int64)
        host[0, :batch] = torch.tensor(tokens)
        host[1, :batch] = torch.tensor(starts)
        step = self.steps.get(bs)
        if step is None:
            step = self._capture(pool, bs, host)
            if step is None:
                return None
        else:
            step.inputs.copy_(host)
        logits, routes = step.call()
        self.replays += 1
        self.runner._captured = {layer: ids[:batch] for layer, ids in routes.items()}
        routes_BLK = self.runner._routes(batch, 1)[:, 0]
        return logits[:batch, -1].to(torch.float32, copy=True), routes_BLK

    def _capture(self, pool: KVPool, bs: int, host: torch.Tensor) -> _Step | None:
        runner = self.runner
        inputs = host.to(runner.device)
        plan = _StaticPlan(bs, pool.capacity, inputs[1].view(bs, 1))
        ids = inputs[0].view(bs, 1)

        def forward() -> Outputs:
            runner._captured.clear()
            with runner.experts_as(self.experts):
                logits = runner.run_model(pool, plan, ids, logits_to_keep=1)
            routes = dict(runner._captured)
            runner._captured.clear()
            return logits, routes

        try:
            call = self.capture(forward)
        except Exception as err:  # the eager forward still works: use it from now on
            self.disabled = f"capturing the decode step of {bs} rows failed: {err}"
            self.clear()
            log.warning(
                "CUDA graphs are off for this engine: %s; decode runs eagerly (start the "
                "engine with --disable-cuda-graph to skip the capture)",
                self.disabled,
            )
            return None
        self.captures += 1
        step = _Step(inputs, plan, call)
        self.steps[bs] = step
        return step

    def info(self) -> dict[str, Any]:
        """For the server's info: SGLang's names where it has them."""
        return {
            "disable_cuda_graph": False,
            "cuda_graph_max_bs": self.max_bs,
            "cuda_graph_bs": list(self.sizes),
            "cuda_graph_captures": self.captures,
            "cuda_graph_experts": self.experts,
            "cuda_graph_disabled_reason": self.disabled,
        }
