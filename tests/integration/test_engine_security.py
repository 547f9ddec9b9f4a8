"""Issue 16, item 5: impossible weight groups are refused at once, and the API key travels
in the environment (the store's address: tests/unit/test_sync_group.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from engine_http import KEY

from moerl.engine import API_KEY_ENV
from moerl.parallel.spawn import free_port
from moerl.rollout import EngineClient

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.mark.parametrize(
    "values, field",
    [
        ({"rank_offset": 2, "world_size": 2}, "rank_offset"),
        ({"rank_offset": -1, "world_size": 2}, "rank_offset"),
        ({"rank_offset": 1, "world_size": 0}, "world_size"),
        ({"rank_offset": 1, "world_size": 2, "master_port": 70000}, "master_port"),
        ({"rank_offset": "1", "world_size": 2}, "rank_offset"),
    ],
)
def test_impossible_weight_groups_are_400_at_once(http, values, field):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), **values}
    r = http.post("/init_weights_update_group", body, timeout=5)  # not the store's 300 s
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(field)


def test_the_api_key_comes_from_the_environment(robust_engine, monkeypatch):
    """EngineProcess hands its engine the key in MOERL_API_KEY, off the command line that
    `ps` shows; the engine requires it (health probes stay open, as SGLang's); a client
    with no api_key= reads it from the same variable."""
    cmdline = Path(f"/proc/{robust_engine.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline and b"--api-key" not in cmdline
    url = robust_engine.url
    assert httpx.post(f"{url}/generate", json=GEN, timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    monkeypatch.setenv(API_KEY_ENV, KEY)

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([url]) as client:
            return await client.generate([5, 6], GEN["sampling_params"])

    assert asyncio.run(go())["meta_info"]["completion_tokens"] == 2
