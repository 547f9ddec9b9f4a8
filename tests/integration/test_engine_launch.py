"""The launcher's embedded engine: a fresh API key per run that its clients send (issue 16,
item 5), and SIGTERM stops it even with a request waiting on a paused engine (item 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading

import httpx
import pytest
from engine_http import Http

from moerl.config.schema import MoerlConfig
from moerl.engine import API_KEY_ENV
from moerl.launch import start_engines
from moerl.rollout import EngineClient

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, tmp_path_factory):  # type: ignore[no-untyped-def]
    cfg = MoerlConfig()
    cfg.engine.threads = 1
    saved = os.environ.pop(API_KEY_ENV, None)
    procs = []
    try:
        _, procs = start_engines(cfg, tiny_checkpoints["qwen3_moe"], tmp_path_factory.mktemp("run"))
        yield procs[0], os.environ[API_KEY_ENV]
    finally:
        for proc in procs:
            proc.close()
        os.environ.pop(API_KEY_ENV, None)
        if saved is not None:
            os.environ[API_KEY_ENV] = saved


def test_the_launcher_gives_its_engines_a_key_its_clients_send(launched):
    eng, key = launched
    assert len(key) >= 32 and eng.api_key == key
    assert httpx.post(f"{eng.url}/generate", json=GEN, timeout=10).status_code == 401

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([eng.url]) as client:  # the run's client: key from the env
            return await client.generate([5, 6], GEN["sampling_params"])

    assert asyncio.run(go())["meta_info"]["completion_tokens"] == 2


def test_sigterm_stops_an_engine_with_a_request_in_flight(launched):
    """Runs last in this module: it stops the engine."""
    eng, key = launched
    http = Http(eng.url, key)
    assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    box: dict = {}

    def waiting_request() -> None:
        try:
            box["r"] = http.post("/generate", GEN)
        except httpx.HTTPError as err:
            box["r"] = err

    thread = threading.Thread(target=waiting_request)
    thread.start()
    http.wait_for("the request queued", lambda i: i["waiting_requests"] == 1)
    eng.proc.send_signal(signal.SIGTERM)
    try:
        assert eng.proc.wait(timeout=20) is not None
    except subprocess.TimeoutExpired:
        eng.proc.kill()
        raise AssertionError("the engine ignored SIGTERM with a request in flight") from None
    thread.join()
    r = box["r"]
    assert isinstance(r, httpx.HTTPError) or r.status_code == 503


def test_an_engine_started_without_waiting_is_waited_for_later(tmp_path, tiny_checkpoints):
    """The launcher starts its engines without waiting (the trainer builds meanwhile):
    ``wait_healthy`` then returns once /health answers, and an engine that exits at
    start-up raises there with its log's tail. A log of its own in the temporary
    directory goes with a clean stop and stays after a failed start (its error names it)."""
    from moerl.engine.process import EngineProcess

    with EngineProcess(tiny_checkpoints["deepseek_moe"], wait=False) as engine:
        engine.wait_healthy()
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code in (200, 401)
        assert engine.log_path.exists()
    assert not engine.log_path.exists()
    broken = EngineProcess(tmp_path / "no-such-model", wait=False, startup_timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="engine exited with code") as info:
            broken.wait_healthy()
    finally:
        broken.close()
    assert str(broken.log_path) in str(info.value) and broken.log_path.exists()
    broken.log_path.unlink()


def test_an_engine_handed_to_another_process_is_watched_restarted_and_stopped(tiny_checkpoints):
    """The launcher starts the engines and pickles them to trainer rank 0, which did not
    start them: the handle sees a live engine, sees it gone once it died (still a zombie
    of its unreaped parent: here the test process, which has not waited on it), restarts
    it on the same port as its own child and stops it."""
    import pickle

    from moerl.engine.process import Adopted, EngineProcess

    with EngineProcess(tiny_checkpoints["deepseek_moe"]) as started:
        handle = pickle.loads(pickle.dumps(started))
        assert isinstance(handle.proc, Adopted) and handle.proc.pid == started.proc.pid
        assert handle.alive() and handle.url == started.url
        os.kill(started.proc.pid, signal.SIGKILL)
        handle.proc.wait(timeout=30)  # polls /proc until the zombie shows
        assert not handle.alive() and "unknown code" in handle.exit_status()
        assert started.proc.wait(timeout=10) == -signal.SIGKILL  # its parent reaps it now
        handle.restart()
        try:
            assert isinstance(handle.proc, subprocess.Popen) and handle.restarts == 1
            assert httpx.get(f"{handle.url}/health", timeout=5).status_code == 200
            assert "engine restarted (1)" in handle.log_path.read_text()
        finally:
            handle.close()
        assert handle.proc.returncode is not None
