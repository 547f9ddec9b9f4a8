"""``batches.jsonl``: what each step trained on (prompt groups, token versions).

Data provenance for a run: one line per step with the prompt positions (group ids) of
its trajectories and how many tokens each policy version contributed. Like
metrics.jsonl it is cut back to the resume step, so a resumed run's file lists every
completed step exactly once.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from moerl.telemetry.jsonl import AppendFile, encode_line, iter_records

BATCHES_FILE = "batches.jsonl"


def read_batches(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(run_dir) / BATCHES_FILE
    return list(iter_records(path)) if path.exists() else []


class BatchLog:
    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int = 0) -> None:
        self.path = Path(run_dir) / BATCHES_FILE
        if self.path.exists():
            keep = [r for r in iter_records(self.path) if int(r.get("step", -1)) < resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(b"".join(encode_line(r) for r in keep))
            os.replace(tmp, self.path)
        self._file = AppendFile(self.path)

    def log(self, step: int, trajs: list[Any]) -> None:
        versions = Counter(int(v) for t in trajs for v in np.asarray(t.versions).tolist())
        groups = sorted({int(t.group_id) for t in trajs if t.group_id is not None})
        self._file.write(
            {"step": step, "groups": groups, "versions": {str(k): n for k, n in versions.items()}}
        )

    def close(self) -> None:
        self._file.close()
