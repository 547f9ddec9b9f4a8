"""Shared fixtures: tiny HF checkpoints (no download) and embedded-engine servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moerl.parallel.spawn import free_port


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family → a tiny random HF checkpoint written with transformers' own classes."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("tiny-hf")
    return {
        f: save_tiny_checkpoint(tiny_config(f), root / f, seed=0)
        for f in ("deepseek_moe", "qwen3_moe")
    }


class EngineProcess:
    """``python -m moerl.engine`` on a free loopback port (a real server, real HTTP)."""

    def __init__(self, model_path: Path, *extra: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [
            sys.executable,
            "-m",
            "moerl.engine",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
        ]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [*args, "--num-threads", "1", *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode() if self.proc.stdout else ""
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{out[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("engine did not become healthy within 120 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def engine_factory() -> Iterator:
    started: list[EngineProcess] = []

    def start(model_path: Path, *extra: str, api_key: str | None = None) -> EngineProcess:
        eng = EngineProcess(model_path, *extra, api_key=api_key)
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.close()


@pytest.fixture(scope="session")
def ds_engine(tiny_checkpoints, engine_factory) -> EngineProcess:
    """A DeepSeek-architecture engine with routed-experts capture on."""
    return engine_factory(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
