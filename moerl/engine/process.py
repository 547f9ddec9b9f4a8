"""Start ``python -m moerl.engine`` as a child process and wait until it is healthy.

Used by the launcher (embedded engines), benchmarks and tests. The child's output
goes to a log file, never to an unread pipe that could fill and block it. An API key
reaches the child through its environment (MOERL_API_KEY), never its command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx

from moerl.engine import API_KEY_ENV
from moerl.parallel.spawn import die_with_parent, free_port


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
    ) -> None:
        """``wait`` False: return once the process is started; ``wait_healthy()`` later
        (the launcher builds the trainer meanwhile)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        args = [sys.executable, "-m", "moerl.engine", "--model-path", str(model_path)]
        args += ["--port", str(self.port), "--num-threads", str(threads)]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="moerl-engine-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._argv = [*args, *extra]
        self._env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if self.api_key:  # in the environment, not the command line that `ps` shows
            self._env[API_KEY_ENV] = self.api_key
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._spawn()
        if wait:
            self._wait_healthy(startup_timeout_s)

    def wait_healthy(self) -> None:
        """Block until ``/health`` answers 200 (within ``startup_timeout_s`` of now); an
        engine that exits first raises with its log's tail."""
        self._wait_healthy(self.startup_timeout_s)

    def _spawn(self) -> None:
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
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
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
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with code {self.proc.returncode}; its log ({self.log_path}):\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(
            f"engine did not become healthy within {timeout_s:.0f} s; log: {self.log_path}"
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
