"""Running untrusted Python in a subprocess with limits (the `code` reward's sandbox).

Each run gets a fresh temporary working directory (deleted after) and a new process
(`python -I -B harness.py`, an empty environment, its own session) that is:

    guaranteed (Linux)    killed (its whole process group) at `timeout_s` wall time;
                          capped at `memory_mb` of address space (RLIMIT_AS: allocation
                          past it raises MemoryError), `cpu_s` of CPU (RLIMIT_CPU), files
                          of at most `output_bytes` (RLIMIT_FSIZE; stdout goes to such a
                          file, so a flood stops there) and 64 open files
    best effort           no network: with `isolate_network` it runs in a fresh network
                          namespace (`unshare -rn`, only where unprivileged user namespaces
                          are allowed), and always under an audit hook that refuses
                          socket creation, subprocesses, fork/exec, ctypes, signals to
                          other processes and writes outside its working directory
    not guaranteed        it still reads any file its user can read and shares the CPU;
                          code that reaches C (a C extension already importable) can go
                          around the audit hook. This bounds a model's accidents and
                          runaway programs; it is not a boundary against an adversary. Run
                          the trainer in a container for that.

The limits are set by the harness on itself before the program is read, not in a
preexec_fn: preexec_fn may deadlock in a process with threads, and rewards run in threads.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")


@dataclass
class Limits:
    timeout_s: float = 10.0
    """Wall time of one run; the process group is killed past it."""
    cpu_s: int = 0
    """CPU seconds (RLIMIT_CPU); 0 = ceil(timeout_s)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS), MiB."""
    output_bytes: int = 1_000_000
    """Largest file the program may write, its stdout included (RLIMIT_FSIZE)."""
    isolate_network: bool = True
    """Run in a fresh network namespace when the system allows it (`unshare -rn`)."""


@dataclass
class RunResult:
    """What one sandboxed run left behind."""

    returncode: int | None
    """The exit status (negative: killed by that signal); None when timed out."""
    timed_out: bool
    elapsed_s: float
    stdout: str
    """At most output_bytes of it, decoded with errors replaced."""
    stderr_tail: str
    """The last 500 characters of stderr (the traceback)."""
    results: list[dict] = field(default_factory=list)
    """MODE=tests: one {"ok": bool, "error"?: str} per finished test, or [{"load_error"}]."""


def run_python(
    code: str, limits: Limits, tests: list[str] | None = None, stdin: str = ""
) -> RunResult:
    """Run `code` against `tests` (statements executed after it), or as a script on
    `stdin` when tests is None."""
    cpu = limits.cpu_s or max(1, int(limits.timeout_s + 0.999))
    cfg = {"memory_mb": limits.memory_mb, "cpu_s": cpu, "output_bytes": limits.output_bytes}
    cmd = [sys.executable, "-I", "-B", str(HARNESS), json.dumps(cfg)]
    cmd.append("tests" if tests is not None else "run")
    if limits.isolate_network and _can_unshare():
        cmd = ["unshare", "-rn", *cmd]
    with tempfile.TemporaryDirectory(prefix="moerl-sandbox-") as work:
        root = Path(work)
        (root / "solution.py").write_text(code, encoding="utf-8")
        if tests is not None:
            (root / "tests.json").write_text(json.dumps(tests), encoding="utf-8")
        (root / "stdin.txt").write_text(stdin, encoding="utf-8")
        with (
            open(root / "stdin.txt", "rb") as fin,
            open(root / "stdout.txt", "wb") as fout,
            open(root / "stderr.txt", "wb") as ferr,
        ):
            start = time.monotonic()
            proc = subprocess.Popen(
                cmd, cwd=work, env={}, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True
            )
            try:
                returncode: int | None = proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            finally:
                _kill_group(proc)
            elapsed = time.monotonic() - start
        return RunResult(
            returncode=returncode,
            timed_out=timed_out,
            elapsed_s=elapsed,
            stdout=_read(root / "stdout.txt", limits.output_bytes),
            stderr_tail=_read(root / "stderr.txt", 1 << 16)[-500:],
            results=_results(root / "results.jsonl"),
        )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (anything it started too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: Path, limit: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _results(path: Path) -> list[dict]:
    out = []
    for line in _read(path, 1 << 20).splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the kill
    return out


@functools.cache
def _can_unshare() -> bool:
    """Whether `unshare -rn` (a user + network namespace) works here; probed once."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
