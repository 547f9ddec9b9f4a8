"""Activity spans per process: the generation-vs-training timeline of an async run.

The point of asynchronous RL is that engines generate while the trainer trains; the
timeline shows whether they really overlap, and where each side waits. Every process
(trainer rank 0, the orchestrator, each engine) records what it is doing as spans::

    tl = Timeline(run_dir, "orchestrator")
    async def one(prompt):
        with tl.span("generate", rid=prompt.id):   # concurrent spans may overlap
            await client.generate(...)
    with tl.span("train", step=step): ...
    with tl.span("sync", version=step): ...
    with tl.span("wait"): ...

Each finished span is one line ``{"process", "kind", "start", "end", **attrs}`` (unix
seconds from ``time.time()``, so spans from different processes and the per-step
``wall_time`` of ``metrics.jsonl`` share a clock) in
``run_dir/timeline.<process>.jsonl``. One file per process means no cross-process
locking; within a process, each line is one ``os.write`` on an ``O_APPEND`` descriptor,
so concurrent asyncio tasks and threads never interleave lines. A span is written when
it ends: a crash loses only the spans still open.

``load_timeline(run_dir)`` merges all processes' files, sorted by start time.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from moerl.telemetry.jsonl import AppendFile, iter_records

_PROCESS_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_RESERVED = ("process", "kind", "start", "end")


def timeline_path(run_dir: str | os.PathLike[str], process: str) -> Path:
    return Path(run_dir) / f"timeline.{process}.jsonl"


class Span:
    """One open activity; a context manager for both ``with`` and ``async with``.

    ``span.attrs`` may be extended inside the block (e.g. tokens generated) and is
    written when the span ends. An exception inside the block is recorded as
    ``error`` (its type name) and propagates.
    """

    def __init__(self, timeline: Timeline, kind: str, attrs: dict[str, Any]):
        self._timeline = timeline
        self.kind = kind
        self.attrs = attrs
        self.start: float | None = None

    def __enter__(self) -> Span:
        self.start = time.time()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        end = time.time()
        assert self.start is not None, "Span exited without entering"
        if exc_type is not None:
            self.attrs.setdefault("error", exc_type.__name__)
        self._timeline.record(self.kind, self.start, end, **self.attrs)

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.__exit__(exc_type, *exc)


class Timeline:
    """Records spans of one process to ``run_dir/timeline.<process>.jsonl``.

    ``enabled=False`` gives a timeline whose spans cost two ``time.time()`` calls and
    write nothing, so code can always wrap its phases without checking a flag.
    """

    def __init__(self, path: str | os.PathLike[str], process: str, *, enabled: bool = True):
        if not _PROCESS_RE.match(process):
            raise ValueError(
                f"timeline process name {process!r} must be letters, digits, '_', '.', '-' "
                "(it becomes part of the file name timeline.<process>.jsonl)"
            )
        self.process = process
        self.run_dir = Path(path)
        self.path = timeline_path(self.run_dir, process)
        self.enabled = enabled
        self._file = AppendFile(self.path) if enabled else None

    def span(self, kind: str, **attrs: Any) -> Span:
        """A context manager timing one activity (``generate``, ``train``, ``sync``, ...)."""
        bad = [k for k in attrs if k in _RESERVED]
        if bad:
            raise ValueError(f"span attrs may not be named {bad}: {_RESERVED} are reserved")
        return Span(self, kind, attrs)

    def record(self, kind: str, start: float, end: float, **attrs: Any) -> None:
        """Write a span measured elsewhere (e.g. timings an engine reported)."""
        if self._file is None:  # disabled or closed
            return
        if end < start:
            raise ValueError(f"span {kind!r} ends ({end}) before it starts ({start})")
        bad = [k for k in attrs if k in _RESERVED]
        if bad:
            raise ValueError(f"span attrs may not be named {bad}: {_RESERVED} are reserved")
        self._file.write(
            {"process": self.process, "kind": kind, "start": start, "end": end, **attrs}
        )

    def close(self) -> None:
        """Stop writing; spans still open (e.g. cancelled requests) end unrecorded."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_timeline(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every span of every process in ``run_dir``, sorted by start time.

    Lines missing ``process``/``kind``/``start``/``end`` are skipped; an empty list
    means no process recorded a timeline.
    """
    spans: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir).glob("timeline.*.jsonl")):
        for record in iter_records(path):
            if all(record.get(k) is not None for k in _RESERVED):
                spans.append(record)
    spans.sort(key=lambda s: (s["start"], s["process"]))
    return spans
