"""Engines for the robustness tests: a real engine process on the tiny model, and one in
this process (for the faults only reachable through its Python objects)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from engine_http import KEY, Http, InProcessEngine

from moerl.engine.process import EngineProcess
from moerl.engine.weights.group import init_custom_process_group
from moerl.parallel.spawn import free_port


@pytest.fixture(scope="session")
def robust_engine(tiny_checkpoints) -> Iterator[EngineProcess]:
    """qwen3 tiny engine with LoRA, small limits, and an API key it reads from its
    environment (EngineProcess puts it there)."""
    eng = EngineProcess(
        tiny_checkpoints["qwen3_moe"],
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-running-requests",
        "4",
        "--max-queued-requests",
        "3",
        api_key=KEY,
        threads=1,
    )
    yield eng
    eng.close()


@pytest.fixture()
def http(robust_engine) -> Iterator[Http]:
    """The robust engine, left running (not paused) after each test."""
    client = Http(robust_engine.url, KEY)
    yield client
    client.post("/continue_generation")


@pytest.fixture(scope="session")
def inprocess_engine(tiny_checkpoints) -> Iterator[InProcessEngine]:
    """Shared: a test that installs a fault removes it (the death test makes its own)."""
    eng = InProcessEngine(tiny_checkpoints["qwen3_moe"])
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def own_engine(tiny_checkpoints) -> Iterator[InProcessEngine]:
    """A qwen3 tiny engine in this process for the test module alone: its pushes change
    its weights."""
    eng = InProcessEngine(tiny_checkpoints["qwen3_moe"])
    yield eng
    eng.close()


@pytest.fixture()
def weight_group(http):  # type: ignore[no-untyped-def]
    """This process as trainer rank 0, the engine as rank 1 of a gloo group."""
    port = free_port()
    box: dict = {}
    joiner = threading.Thread(
        target=lambda: box.setdefault(
            "g", init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=30)
        )
    )
    joiner.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    r = http.post("/init_weights_update_group", {**body, "world_size": 2, "group_name": "nf"})
    joiner.join()
    assert r.status_code == 200, r.text
    yield box["g"]
    http.post("/destroy_weights_update_group", {"group_name": "nf"})
