"""Warm engine processes (moerl/engine/process.py ``WarmEngine``, the engine's
``--await-start``): the launcher starts its engines before its checks import torch, and
each goes on as the engine once the checked config asks for the same one, with the API
key off its command line and environment."""

from __future__ import annotations

import asyncio
import secrets
import signal
from pathlib import Path

import httpx
import pytest

from moerl.engine import API_KEY_ENV
from moerl.engine.process import EngineProcess, WarmEngine
from moerl.rollout import EngineClient

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def _proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def test_a_warm_process_becomes_the_engine_its_order_names(tiny_checkpoints, tmp_path, monkeypatch):
    """Also where the launcher's own imports set a variable the engine reads only later
    (torch's compile cache directory, ``LATE_ENV``) after the warm process started."""
    key = secrets.token_urlsafe(32)
    model = tiny_checkpoints["deepseek_moe"]
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    warm = WarmEngine(model, "--enable-return-routed-experts", threads=1)
    assert b"--await-start" in _proc_file(warm.proc.pid, "cmdline")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    log = tmp_path / "engine.log"
    with EngineProcess(
        model, "--enable-return-routed-experts", api_key=key,
        threads=1, log_path=log, wait=False, warm=warm,
    ) as engine:  # fmt: skip
        assert engine.proc is warm.proc and engine.port == warm.port  # no second process
        engine.wait_healthy()
        cmdline, environ = (
            _proc_file(engine.proc.pid, "cmdline"),
            _proc_file(engine.proc.pid, "environ"),
        )
        assert b"moerl.engine\0--model-path\0" + str(model).encode() in cmdline  # as ps shows
        assert key.encode() not in cmdline and key.encode() not in environ
        assert f"{API_KEY_ENV}=".encode() not in environ
        assert httpx.post(f"{engine.url}/generate", json=GEN, timeout=10).status_code == 401

        async def go():  # type: ignore[no-untyped-def]
            async with EngineClient([engine.url], api_key=key) as client:
                return await client.generate(
                    [5, 6], GEN["sampling_params"], return_routed_experts=True
                )

        answer = asyncio.run(go())
        assert answer["meta_info"]["completion_tokens"] == 2
        assert answer["meta_info"]["routed_experts"]  # its flags are the order's
        assert "Loading weights" in log.read_text()  # its stderr went to the order's log


@pytest.mark.parametrize("differs", [pytest.param("threads", marks=pytest.mark.slow), "flags"])
def test_a_warm_process_started_for_another_engine_gives_way_to_a_fresh_one(
    tiny_checkpoints, tmp_path, differs
):
    """A checked config that asks for another engine than the warm process was started
    for (another thread count: OMP_NUM_THREADS is read as torch loads; other flags) gets
    a fresh engine, and the warm process is stopped."""
    model = tiny_checkpoints["qwen3_moe"]
    warm = WarmEngine(model, *(["--disable-radix-cache"] if differs == "flags" else []),
                      threads=2 if differs == "threads" else 1)  # fmt: skip
    with EngineProcess(model, threads=1, log_path=tmp_path / "e.log", warm=warm) as engine:
        assert engine.proc is not warm.proc
        assert warm.proc.returncode == -signal.SIGKILL
        assert b"--await-start" not in _proc_file(engine.proc.pid, "cmdline")
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code in (200, 401)


def test_a_warm_process_that_gets_no_order_is_stopped_by_close(tiny_checkpoints):
    warm = WarmEngine(tiny_checkpoints["qwen3_moe"], threads=1)
    assert warm.proc.poll() is None
    warm.close()
    assert warm.proc.returncode == -signal.SIGKILL
    warm.close()  # twice is harmless
