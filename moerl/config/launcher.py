"""Launcher: how many trainer processes and which collective backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

BACKENDS = ("gloo", "nccl")
PLACEMENTS = ("disaggregated", "colocated")


@dataclass
class LauncherConfig:
    """Process layout of the trainer on this node."""

    nproc: int | None = None
    """Trainer processes (the world size); None = WORLD_SIZE from torchrun, else 1."""
    threads: int | None = None
    """torch CPU threads per locally spawned trainer rank; None = by the core split of
    moerl/config/threads.py (CPU cores / ranks, less the engines' share when generation
    overlaps training)."""
    omp_spincount: int | None = 50000
    """``GOMP_SPINCOUNT`` for the run's processes (trainer ranks, embedded engines), set by
    the launcher before torch loads when the environment sets neither it nor
    ``OMP_WAIT_POLICY``: how many times an idle OpenMP thread of torch's CPU ops polls for
    more work before it sleeps. libgomp's default (300000) kept the trainer's idle thread
    busy on a core for milliseconds after each burst of ops, through the weight push that
    the engine needed that core for (moerl/config/threads.py). 0 sleeps at once; None
    leaves libgomp's default."""
    malloc_keep_mb: int | None = 256
    """glibc's allocator keeps this many MiB a process freed (its trim threshold) and
    serves blocks up to min(this, 32) MiB from its heap, for every process of the run,
    unless the environment sets ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TOP_PAD_``: a CPU step frees and allocates megabyte tensors every op, and
    glibc's default maps them afresh each time, so every step paid page faults again
    (the engine's decode step 8.3 → 5.3 ms; moerl/config/threads.py). 0 or None leaves
    glibc's default. No effect without glibc."""
    gc_freeze: bool = True
    """Python's garbage collector stays off while the launcher's process starts (the
    embedded engine's own start does the same: it freezes what loaded); after the run's
    first step every trainer rank and every engine (SGLang's /freeze_gc) collects once,
    freezes the objects alive then (``gc.freeze``) and collects as usual from there, so
    full collections no longer scan the model, the optimizer and the imports: four of
    them cost 0.6 s of the tiny recipe's start, and each later one stalled a step by
    160-220 ms (moerl/common/gc_freeze.py). A restarted engine is frozen again."""
    dry_run: bool = False
    """Validate the config, print it and exit without starting anything."""
    backend: str | None = None
    """torch.distributed backend: 'gloo' or 'nccl'; None = nccl with CUDA, gloo without."""
    placement: str = "disaggregated"
    """Where the embedded engine runs. 'disaggregated': its own process(es)
    (``engine.num_engines``), reached over HTTP, weights by broadcast or shared memory;
    generation can overlap training on cores or GPUs of its own. 'colocated': one engine
    inside trainer rank 0's process, sharing its devices and threads, reached without a
    socket, weights handed over as tensor handles (``sync.transport`` auto or tensor);
    with one rank the launcher itself is that rank (one process in all). Colocated suits a laptop or one GPU with the synchronous schedule; with
    async the engine and the trainer take turns on the same cores (see README,
    "Placement")."""
    sleep_engine: bool | None = None
    """With placement=colocated and a synchronous schedule (staleness=sync): the engine
    frees its KV cache while the trainer steps, and its weights too before a full-weight
    push (SGLang's /release_memory_occupation and /resume_memory_occupation, as verl's and
    slime's colocated engines sleep), so training has the device's memory to itself.
    None = on with CUDA, off on CPU (one memory: nothing to gain, and re-allocating costs)."""

    def world_size(self) -> int:
        """The world size the config is validated against."""
        env = os.environ.get("WORLD_SIZE")
        if self.nproc is None:
            return int(env) if env else 1
        if env and int(env) != self.nproc:
            raise ValueError(
                f"launcher.nproc={self.nproc} but WORLD_SIZE={env} (set by torchrun); "
                "drop launcher.nproc or make the two agree"
            )
        return self.nproc
