"""Start ``python -m moerl.engine`` as a child process and wait until it is healthy.

Used by the launcher (embedded engines), benchmarks and tests. The child's output
goes to a log file, never to an unread pipe that could fill and block it. An API key
reaches the child through its environment (MOERL_API_KEY), never its command line.

An EngineProcess pickles into a handle that another process (the launcher's engines,
handed to trainer rank 0) can watch, stop and restart: it signals the engine by pid and
reads its state from /proc; a restart makes the new engine that process's own child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from moerl.common.children import die_with_parent, free_port
from moerl.engine import API_KEY_ENV


def engine_argv(model_path: str | Path, port: int, threads: int, extra: Sequence[str]) -> list[str]:
    """The command line of ``python -m moerl.engine`` on ``model_path`` and ``port``."""
    args = [sys.executable, "-m", "moerl.engine", "--model-path", str(model_path)]
    return [*args, "--port", str(port), "--num-threads", str(threads), *extra]


class EngineProcess:
    """One embedded engine on a loopback port; ``close()`` (or context exit) stops it."""

    def __init__(
        self,
        model_path: str | Path,
        *extra: str,
        api_key: str | None = None,
        threads: int = 1,
        port: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
        wait: bool = True,
        warm: WarmEngine | None = None,
    ) -> None:
        """``wait`` False: return once the process is started; ``wait_healthy()`` later
        (the launcher builds the trainer meanwhile). ``warm``: the process started for this
        engine before the config was checked (``WarmEngine``; its port is the engine's
        unless ``port`` says otherwise); it becomes the engine where its command line and
        environment are this one's, and is closed otherwise. Restarts start fresh ones."""
        self.port = port or (warm.port if warm is not None else free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self._temp_log = log_path is None  # ours to remove once the engine stopped cleanly
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="moerl-engine-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: Any = None
        self.proc: subprocess.Popen[bytes] | Adopted
        self._argv = engine_argv(model_path, self.port, threads, extra)
        self._env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if self.api_key:  # in the environment, not the command line that `ps` shows
            self._env[API_KEY_ENV] = self.api_key
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._warm = warm
        self._spawn()
        if wait:
            self._wait_healthy(startup_timeout_s)

    def wait_healthy(self) -> None:
        """Block until ``/health`` answers 200 (within ``startup_timeout_s`` of now); an
        engine that exits first raises with its log's tail."""
        self._wait_healthy(self.startup_timeout_s)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("proc", "_log", "_warm")}
        return {**state, "_pid": self.proc.pid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pid = state.pop("_pid")
        self.__dict__.update(state, _log=None, _warm=None)
        self.proc = Adopted(pid)

    def _spawn(self) -> None:
        if self._log is None:
            self._log = self.log_path.open("ab")
        warm, self._warm = self._warm, None
        if warm is not None:
            proc = warm.take(self._argv, self.log_path, self._env)
            if proc is not None:
                self.proc = proc
                return
        self.proc = subprocess.Popen(
            self._argv,
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # in the child before exec: a killed run leaves no orphan engine
            preexec_fn=partial(die_with_parent, os.getpid()),
        )

    def restart(self, wait: bool = True) -> None:
        """Stop the process if it still runs (a hung engine), start it again on the same
        port with the same flags (the initial weights), and optionally wait until it is
        healthy. Linux ties the engine's life to the *thread* that starts it: restart
        from a thread that lives as long as the run."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._log.write(f"\n--- moerl: engine restarted ({self.restarts + 1}) ---\n".encode())
        self._log.flush()
        self.restarts += 1
        self._spawn()
        if wait:
            self._wait_healthy(self.startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"engine exited with {self.exit_status()}; its log ({self.log_path}):\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.close(keep_log=True)
        raise RuntimeError(
            f"engine did not become healthy within {timeout_s:.0f} s; log: {self.log_path}"
        )

    def alive(self) -> bool:
        if isinstance(self.proc, Adopted):
            return self.proc.running()
        return self.proc.poll() is None

    def exit_status(self) -> str:
        """How the process ended, for messages ("code 1"; unknown for an adopted one)."""
        if isinstance(self.proc, Adopted):
            return "an unknown code (it was started by another process)"
        return f"code {self.proc.poll()}"

    def close(self, keep_log: bool = False) -> None:
        """Stop the engine. A log of its own in the temporary directory (no ``log_path``
        given) is removed when the engine was still running, so nothing went wrong that
        the log would explain; an engine that exited first keeps it, as ``keep_log`` does."""
        stopped_here = self.alive()
        if stopped_here:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._temp_log and stopped_here and not keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


LATE_ENV = frozenset({API_KEY_ENV, "TORCHINDUCTOR_CACHE_DIR"})
"""Environment variables an engine reads only after its start's imports, which a warm
engine's order passes on: the API key, and torch's compile cache directory (torch sets
it in the launcher itself when its checks import torch's compile stack)."""


class WarmEngine:
    """An engine started before its run's config is checked: ``python -m moerl.engine``
    with the flags the launcher expects to give it and ``--await-start``, so it imports
    what it needs, then waits on its stdin for the order to go on (``take``). Until then
    its output goes nowhere; ``close`` ends it where it got no order."""

    def __init__(self, model_path: str | Path, *extra: str, threads: int = 1) -> None:
        self.port, self.threads = free_port(), threads
        self.argv = engine_argv(model_path, self.port, threads, extra)
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [*self.argv, "--await-start"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=partial(die_with_parent, os.getpid()),
        )

    def take(
        self, argv: list[str], log_path: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes] | None:
        """The process, told to go on as the engine ``argv`` and ``env`` describe, with
        its output in ``log_path`` and ``env``'s ``LATE_ENV`` (the API key among them);
        None where it cannot be that engine (it exited, or was started with other flags
        or another environment: the checked config differs from the one it was started
        for, or a variable it read as it started changed since), in which case it is
        closed."""
        early = {k: v for k, v in env.items() if k not in LATE_ENV}
        same = argv == self.argv and early == {
            k: v for k, v in self.env.items() if k not in LATE_ENV
        }
        if not same or self.proc.poll() is not None or self.proc.stdin is None:
            self.close()
            return None
        order = {"log": str(log_path), "env": {k: env[k] for k in sorted(LATE_ENV) if k in env}}
        try:
            self.proc.stdin.write(json.dumps(order).encode() + b"\n")
            self.proc.stdin.close()
        except OSError:  # it died between the check and the write
            self.close()
            return None
        return self.proc

    def close(self) -> None:
        """End the process unless it was told to go on (SIGKILL: it has done nothing)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self.proc.kill()
            self.proc.wait()


class Adopted:
    """The subset of ``subprocess.Popen`` EngineProcess uses, for a process another one
    started: signals go by pid, and a process that exited counts as gone even while it
    waits as a zombie for its parent to reap it (Linux /proc; elsewhere a signal-0
    probe). Its exit code is not ours to read (``returncode`` stays None)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def running(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: ask the kernel whether the pid exists
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return True
        # the leader of a killed process turns zombie before its other threads end (and
        # let go of its port): gone once it is the last one left
        try:
            return len(os.listdir(f"/proc/{self.pid}/task")) > 1
        except FileNotFoundError:
            return False

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return self.returncode
