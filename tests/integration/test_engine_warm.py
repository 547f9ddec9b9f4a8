"""Warm engine processes (moerl/engine/process.py ``WarmEngine``, the engine's
``--await-start``): the launcher starts its engines before its checks import torch, and
each goes on as the engine once the checked config asks for the same one, with the API
key off its command line and environment."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
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


def _bind(port: int) -> OSError | None:
    """The error of binding ``port`` on loopback as a server would, or None."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            return err
    return None


def _sockets(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while listed
            if os.readlink(fd).startswith("socket:"):
                found.append(fd.name)
    return found


def test_an_engine_holds_its_port_from_its_start_and_refuses_until_it_serves(tiny_checkpoints):
    """The port the launcher picked is the engine's before its model loads (a warm
    process, waiting for its order, has it bound): nothing else can take it meanwhile,
    and a client asking then is refused at once instead of waiting."""
    warm = WarmEngine(tiny_checkpoints["qwen3_moe"], threads=1)
    try:
        deadline = time.monotonic() + 60
        # its first socket is the port's, made as it starts, before its imports (probing
        # the port by binding it meanwhile could take it from the engine: not until then)
        while not _sockets(warm.proc.pid):
            assert warm.proc.poll() is None and time.monotonic() < deadline, "no socket"
        refused = _bind(warm.port)
        assert refused is not None and refused.errno == errno.EADDRINUSE
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{warm.port}/health", timeout=30)
    finally:
        warm.close()
    assert _bind(warm.port) is None  # given back with the process


def test_an_engine_whose_port_is_taken_says_so_before_loading(tiny_checkpoints):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "moerl.engine", "--model-path",
             str(tiny_checkpoints["qwen3_moe"]), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "choose another --port" in done.stderr
    assert "Loading weights" not in done.stderr  # no model was loaded first


def test_after_a_failed_push_a_killed_engine_is_restarted_at_once(tiny_checkpoints, tmp_path):
    """``EngineSupervisor.after_failed_push`` (what the loop asks once a push failed):
    the engine answered the run's client a moment before it was killed, so the check
    before a push would not probe it; right after the kill (a killed process resets its
    connections a moment before it can be reaped) it is probed, seen exiting and
    restarted, and the trainer is told to rebuild the weight group."""
    from moerl.rollout.supervisor import EngineSupervisor

    model = tiny_checkpoints["qwen3_moe"]
    with EngineProcess(model, threads=1, log_path=tmp_path / "e.log") as engine:

        async def go():  # type: ignore[no-untyped-def]
            async with EngineClient([engine.url]) as client:
                await client.server_info()  # a fresh answer
                sup = EngineSupervisor(client, [engine.url], [engine], health_timeout_s=5.0)
                engine.proc.send_signal(signal.SIGKILL)
                rebuild = await sup.after_failed_push()
                if sup._http is not None:
                    await sup._http.aclose()
                return rebuild, sup.metrics()

        rebuild, metrics = asyncio.run(go())
        assert rebuild and metrics["engine/restarts"] == 1.0
        assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200
