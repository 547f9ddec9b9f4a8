"""Helpers of the engine robustness tests: an HTTP client with the engine's key and a
client-side timeout, and an engine served in this process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open

from moerl.parallel.spawn import free_port

KEY = "robust-test-key"  # the robust engine's API key


class Http:
    """httpx against one engine, with its key and a client-side timeout on every call."""

    def __init__(self, url: str, key: str | None = None, timeout: float = 30.0) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout

    def post(self, path: str, body: Any = None, *, raw: str | None = None, **kw: Any):  # type: ignore[no-untyped-def]
        kw.setdefault("timeout", self.timeout)
        if raw is not None:
            headers = {**self.headers, "content-type": "application/json"}
            return httpx.post(f"{self.url}{path}", content=raw, headers=headers, **kw)
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, **kw)

    def get(self, path: str, **kw: Any):  # type: ignore[no-untyped-def]
        kw.setdefault("timeout", self.timeout)
        return httpx.get(f"{self.url}{path}", headers=self.headers, **kw)

    def info(self) -> dict[str, Any]:
        return self.get("/server_info").json()

    def wait_for(self, what: str, predicate: Any, timeout: float = 20.0) -> dict[str, Any]:
        """Poll /server_info until ``predicate(info)`` holds (the engine's own state)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if predicate(info):
                return info
            time.sleep(0.02)
        raise AssertionError(f"engine never reached: {what}; last /server_info: {info}")


class InProcessEngine:
    """The engine's app (``build_state``) served by uvicorn on a thread of this process."""

    def __init__(self, model_path: Path, *flags: str) -> None:
        import uvicorn

        from moerl.engine.cli import parse_args
        from moerl.engine.launch import build_state

        port = free_port()
        args = parse_args(["--model-path", str(model_path), "--port", str(port), *flags])
        self.app = build_state(args)
        self.state = self.app.state.engine
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    @contextlib.contextmanager
    def first_decode_waits_for_a_control(self) -> Iterator[None]:
        """While open, the first decode step (a torch hook on the real model) waits until
        a control action is queued (at most 30 s), so a pause lands while a request runs.
        The prefix cache is flushed first: a prompt cached by an earlier test would start
        with a one-token extend, which the hook would hold before any token was sent (the
        test then waited the full 30 s)."""
        sched = self.state.scheduler
        held = threading.Event()
        httpx.post(f"{self.url}/flush_cache", timeout=30).raise_for_status()

        def hold(module, args, kwargs):  # type: ignore[no-untyped-def]
            if kwargs["input_ids"].shape[1] == 1 and not held.is_set():
                held.set()
                deadline = time.monotonic() + 30
                while sched.controls.empty() and time.monotonic() < deadline:
                    time.sleep(0.001)

        handle = self.state.runner.model.register_forward_pre_hook(hold, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's model.safetensors."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


class WeightTrainer:
    """The trainer side of a weight update: rank 0 of a gloo group with one engine."""

    def __init__(self, url: str) -> None:
        from moerl.engine.weights.group import init_custom_process_group
        from moerl.parallel.spawn import free_port

        self.url = url
        port = free_port()
        box: dict = {}
        t = threading.Thread(
            target=lambda: box.setdefault(
                "g", init_custom_process_group("gloo", "127.0.0.1", port, 0, 2)
            )
        )
        t.start()
        r = httpx.post(f"{url}/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "wu", "backend": "gloo",
        }, timeout=120)  # fmt: skip
        t.join()
        assert r.status_code == 200 and r.json()["success"], r.text
        self.group = box["g"]

    def send(self, tensors: dict[str, torch.Tensor], version: str, bucketed: bool) -> dict:
        from moerl.engine.weights.bucket import dtype_name, flatten
        from moerl.engine.weights.group import broadcast

        names = list(tensors)
        body = {
            "names": names,
            "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": "wu",
            "weight_version": version,
            "load_format": "flattened_bucket" if bucketed else None,
            "flush_cache": False,
        }
        box: dict = {}
        # a weight-update session around the load, as SGLang 0.5.23 requires
        assert httpx.post(f"{self.url}/begin_weight_update", json={}).json()["success"]
        t = threading.Thread(
            target=lambda: box.setdefault(
                "r",
                httpx.post(f"{self.url}/update_weights_from_distributed", json=body, timeout=120),
            )
        )
        t.start()
        payload = [flatten(list(tensors.values()))] if bucketed else list(tensors.values())
        for tensor in payload:
            broadcast(self.group, tensor.contiguous())
        t.join()
        assert httpx.post(f"{self.url}/end_weight_update", json={}).json()["success"]
        return box["r"].json()
