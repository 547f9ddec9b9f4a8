"""Append-only JSON-lines logs that survive crashes and concurrent writers.

Run telemetry (``metrics.jsonl``, ``timeline.<process>.jsonl``) is written while the
run may be killed at any moment and, for timelines, by several asyncio tasks or
threads at once. Two rules make that safe without locks:

- every record is encoded to one ``bytes`` line first and handed to a single
  ``os.write`` on an ``O_APPEND`` descriptor, so lines from concurrent writers never
  interleave and nothing sits in a user-space buffer when the process dies;
- readers ignore a trailing line without its newline (the one write a crash cut
  short) and any line that does not parse, instead of failing the whole file.

Non-finite floats are written as ``null`` so the files stay strict JSON for ``jq``
and friends; readers get ``None`` back and plots treat it as a gap.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One record as one newline-terminated UTF-8 line (``default=str`` for odd attrs)."""
    clean = {str(k): _finite(v) for k, v in record.items()}
    return (json.dumps(clean, default=str, allow_nan=False) + "\n").encode("utf-8")


class AppendFile:
    """An ``O_APPEND`` file descriptor that writes whole lines with one syscall each."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = encode_line(record)
        # Regular files take the whole buffer in one call; the loop only guards against
        # exotic file systems returning a short count.
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Complete, parseable records of a JSON-lines file, in file order."""
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return  # cut short by a crash mid-write
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def repair_tail(path: str | os.PathLike[str]) -> None:
    """Drop a trailing partial line so the next append starts on a fresh line."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Walk back block by block to the last newline and cut just after it.
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)
