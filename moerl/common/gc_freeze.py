"""Keeping Python's garbage collector off a run's long-lived objects (``gc.freeze``).

A trainer or engine process holds millions of objects that live as long as it does:
torch's and transformers' modules, megatron-core's model and optimizer state, the
imports. CPython's collector scans all of them in every full (generation 2) collection,
which a step's allocations trigger from time to time: on the 2-core recipe one took 160
to 220 ms, five times in 30 steps, each stalling the step it fell in (the trainer's
process). After ``gc.freeze`` every object alive then sits in a permanent generation
the collector no longer scans, so later collections look only at what the run allocates
since. SGLang offers the same (its ``/freeze_gc`` endpoint and ``Engine.freeze_gc``,
called "after sufficient warmup"); vLLM freezes after its start-up.

Frozen objects are never collected: garbage that exists at the freeze (a reference
cycle not yet found) stays allocated, so the freeze collects first.
"""

from __future__ import annotations

import gc
import time


def freeze_gc() -> tuple[int, float]:
    """Collect every generation once, then freeze what is left (``gc.freeze``). Returns
    (the objects now frozen, the seconds it took). Calling it again freezes what was
    allocated since."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - start
