"""How a CPU machine's cores are split between the trainer ranks and the embedded engines.

On a laptop the trainer and the engines share a few cores. Oversubscribed, torch's
intra-op threads wait on each other and both sides slow down; so each side gets a share
by a stated rule unless the user sets `launcher.threads` / `engine.threads`:

- **alternating** (generation and training take turns: `staleness.max_staleness=0` with
  throttling, the synchronous loop): the trainer ranks split all cores, since the engines
  wait while they train; the engines split all cores but one, since while they generate
  the trainer's process takes their answers and scores them, and an engine's intra-op
  team stalls on every operation whose thread lost its core to that work (the 2-core
  recipe's sync step: 1 engine thread waited 38–40 ms for its batch where 2 waited
  43–46 ms, README "Measured");
- **overlapped** (any other staleness setting, the asynchronous loop): the engines get
  half the cores (at least one thread each), the trainer ranks the rest (at least one
  thread each);
- **colocated** (`launcher.placement=colocated`): the engine lives in rank 0's process;
  the trainer ranks split all cores, and the engine's scheduler thread runs its ops on
  one thread. A second OpenMP team in the process (the scheduler's, beside the
  trainer's) puts libgomp over its core count, and from then on every idle OpenMP thread
  sleeps at once, so each of the trainer's ops waited for its worker to wake: the
  training thread was busy 65% of its step, and a colocated sync step took 115–132 ms
  where one scheduler thread gives 69–71.

With CUDA the engines' and ranks' work is on the GPU and the split does not apply.
``OMP_NUM_THREADS``, when set, caps every process's share (it is the number a user sets
to say how many threads one process may take); `launcher.threads` / `engine.threads`
still override both.

How long an idle thread of a process's OpenMP team keeps its core is a second lever:
libgomp's threads poll for the next parallel region ``GOMP_SPINCOUNT`` times (300000 by
default) before they sleep. Within a training step that polling saves a wake-up per op,
but after the step it held one of the 2-core recipe's cores for milliseconds: through
the weight push, while the rollout thread and the engine passed the push's requests and
answers back and forth (the trainer's idle OpenMP thread used 63% of a core during the
push, and the push took 9.4 ms; polling 50000 times, it stopped, and the push took 7.5).
``launcher.omp_spincount`` (50000) is set for every process of the run unless the
environment already says how OpenMP threads wait (``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY``).

The third is glibc's allocator. A CPU forward allocates and frees tensors of megabytes
every op (DeepSeek's MLA expands every cached token's latent each decode step: 17 MB per
layer for the tiny model's 32-row batch). glibc serves such a block with a fresh
``mmap`` and unmaps it when freed (or grows and trims its heap by it), so every step
faults its pages in again; on a virtual machine each fault is dear. The engine's decode
step of 4 groups of 8 on 128-token prompts took 8.3 ms where keeping the freed memory
took 5.3 (a 32-step batch 0.31 → 0.17 s). ``launcher.malloc_keep_mb`` (256) sets glibc's
trim threshold to that many MiB and its mmap threshold to as much, at most 32 MiB (its
bound), for every process of the run (``mallopt`` in this one, ``MALLOC_*_`` in the
environment for those started after it) unless the environment already tunes malloc;
the memory a step frees then stays mapped for the next. jemalloc or tcmalloc preloaded
(``LD_PRELOAD``) do the same, as PyTorch's CPU performance guide advises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a SLURM allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CoreSplit:
    trainer: int
    """torch threads of each trainer rank."""
    engine: int
    """threads of each embedded engine."""
    rule: str
    """Why: 'alternating', 'overlapped', 'colocated', 'trainer' (no embedded engine),
    'cuda' or 'set' (both given by the user)."""
    omp_cap: int | None = None
    """OMP_NUM_THREADS, where it lowered a share."""


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` when set to a positive integer (None otherwise)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def split_cores(cores: int, ranks: int, engines: int, overlapped: bool) -> CoreSplit:
    """Threads per trainer rank and per embedded engine on ``cores`` CPU cores."""
    ranks, engines, cores = max(1, ranks), max(0, engines), max(1, cores)
    if engines == 0:  # SGLang servers elsewhere: the machine is the trainer's
        return CoreSplit(max(1, cores // ranks), 1, "trainer")
    if not overlapped:
        engine = max(1, (cores - 1) // engines)  # one core for answers and rewards
        return CoreSplit(max(1, cores // ranks), engine, "alternating")
    per_engine = max(1, (cores // 2) // engines)
    trainer = max(1, (cores - per_engine * engines) // ranks)
    return CoreSplit(trainer, per_engine, "overlapped")


def overlapped(staleness: Any) -> bool:
    """Whether generation runs while the trainer trains under this staleness policy."""
    sync = bool(getattr(staleness, "throttle", False)) and staleness.max_staleness == 0
    return not sync


def resolve_threads(cfg: Any, world_size: int, has_cuda: bool) -> CoreSplit:
    """``launcher.threads`` and ``engine.threads`` where set, the rule's split elsewhere."""
    engines = cfg.engine.count() if cfg.engine.kind == "embedded" else 0
    if has_cuda:
        split = CoreSplit(max(1, usable_cores() // world_size), 1, "cuda")
    elif cfg.launcher.placement == "colocated":  # the engine's scheduler: one thread
        split = CoreSplit(max(1, usable_cores() // world_size), 1, "colocated")
    else:
        split = split_cores(usable_cores(), world_size, engines, overlapped(cfg.staleness))
    cap = omp_threads()
    if cap is not None and max(split.trainer, split.engine) > cap:
        split = CoreSplit(min(split.trainer, cap), min(split.engine, cap), split.rule, cap)
    trainer, engine = cfg.launcher.threads, cfg.engine.threads
    rule = "set" if trainer is not None and engine is not None else split.rule
    return CoreSplit(
        split.trainer if trainer is None else trainer,
        split.engine if engine is None else engine,
        rule,
        split.omp_cap if rule != "set" else None,
    )


SPIN_ENV = "GOMP_SPINCOUNT"
"""libgomp's (torch's OpenMP on Linux) polling count for idle threads, read once when the
library loads."""


def set_omp_spincount(spincount: object, environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``spincount`` (``launcher.omp_spincount``) in ``environ``
    (``os.environ``) unless it is None or the environment already chooses how OpenMP
    threads wait (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``). It must run before torch
    loads to count in this process; the processes started after it inherit it. A value
    that is not a non-negative integer is left for the preflight to refuse. Returns
    whether it was set."""
    env = os.environ if environ is None else environ
    if not isinstance(spincount, int) or isinstance(spincount, bool) or spincount < 0:
        return False
    if SPIN_ENV in env or "OMP_WAIT_POLICY" in env:
        return False
    env[SPIN_ENV] = str(spincount)
    return True


MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
"""glibc's malloc tuning variables, read once when a process starts."""
MMAP_THRESHOLD_MAX_MB = 32
"""glibc's bound on the mmap threshold on 64-bit machines (4 x 1024 x 1024 x sizeof(long))."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library is not glibc (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc.mallopt if "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or "") else None
    except (OSError, AttributeError, ValueError):
        return None


def keep_freed_memory(mb: object, environ: MutableMapping[str, str] | None = None) -> bool:
    """``launcher.malloc_keep_mb``: glibc keeps up to ``mb`` MiB that the process freed
    (trim threshold) and serves blocks up to min(mb, 32) MiB from its heap (mmap
    threshold), in this process (``mallopt``) and, through ``environ`` (``os.environ``),
    in the processes started after it. Nothing is done for None or 0, where the
    environment already sets one of ``MALLOC_ENV``, or without glibc; a value that is
    not a non-negative integer is left for the preflight to refuse. Returns whether
    this process was tuned."""
    env = os.environ if environ is None else environ
    if not isinstance(mb, int) or isinstance(mb, bool) or mb <= 0:
        return False
    if any(key in env for key in MALLOC_ENV):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    trim, mmap = mb << 20, min(mb, MMAP_THRESHOLD_MAX_MB) << 20
    env["MALLOC_TRIM_THRESHOLD_"] = str(trim)
    env["MALLOC_MMAP_THRESHOLD_"] = str(mmap)
    return bool(mallopt(_M_TRIM_THRESHOLD, trim)) and bool(mallopt(_M_MMAP_THRESHOLD, mmap))
