"""The embedded engine's HTTP protocol: SGLang's field names, shapes and error paths,
over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{url}{path}", json=body or {}, timeout=120, **kw)


def _info(url: str) -> dict:
    return httpx.get(f"{url}/server_info").json()


def _wait_running(url: str, n: int = 1) -> None:
    for _ in range(500):
        if _info(url)["running_requests"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError("the request never started running")


def _wait_loops(url: str, loops: int) -> dict:
    """/server_info once the scheduler loop has turned ``loops`` times in all."""
    for _ in range(3000):
        info = _info(url)
        if info["scheduler_loops"] >= loops:
            return info
        time.sleep(0.01)
    raise AssertionError(f"the scheduler loop never reached {loops} turns")


def _background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", post(url, "/generate", body)))
    t.start()
    return t, box


LONG = {
    "input_ids": [5, 6],
    "sampling_params": {"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True},
}


def test_generate_response_shape(ds_engine):
    r = post(ds_engine.url, "/generate", {**GEN, "return_logprob": True, "rid": "shape-1"})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 4}]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None and e[0] <= 0 for e in meta["output_token_logprobs"])
    assert "routed_experts" not in meta and "output_token_sampling_mask" not in meta


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({**GEN, "sampling_params": {"max_new_tokens": 2, "foo": 1}}, 400, ["unknown field `foo`"]),
        ({**GEN, "input_ids": [5, 100000]}, 400, ["outside [0, 128)"]),
        ({**GEN, "input_ids": []}, 400, ["non-empty list"]),
        ({**GEN, "input_ids": list(range(5, 125)) * 2}, 400, ["context is 128"]),
        ({**GEN, "sampling_params": {"top_p": 0}}, 400, ["top_p=0"]),
        ({**GEN, "sampling_logprobs_mode": "support"}, 400, ["return_sampling_mask"]),
        (
            {**GEN, "return_routed_experts": True, "routed_experts_start_len": 9},
            400,
            ["routed_experts_start_len=9"],
        ),
        ({**GEN, "lora_path": "nope"}, 400, ["nope"]),
    ],
)
def test_bad_requests_are_400_with_a_reason(ds_engine, body, status, words):
    r = post(ds_engine.url, "/generate", body)
    assert r.status_code == status, r.text
    for word in words:
        assert word in r.text


def test_unknown_top_level_keys_are_ignored_like_sglang(ds_engine):
    assert post(ds_engine.url, "/generate", {**GEN, "custom_thing": 1}).status_code == 200


def test_stop_token_and_ignore_eos(ds_engine):
    free = post(
        ds_engine.url,
        "/generate",
        {**GEN, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()
    stop_at = free["output_ids"][2]
    out = post(
        ds_engine.url,
        "/generate",
        {
            **GEN,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]},
        },
    ).json()
    first = free["output_ids"].index(stop_at)
    assert out["output_ids"] == free["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_n_gives_a_list_with_index_and_rids(ds_engine):
    r = post(
        ds_engine.url,
        "/generate",
        {
            **GEN,
            "rid": "multi",
            "sampling_params": {"max_new_tokens": 3, "n": 3, "temperature": 1.0},
        },
    )
    out = r.json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
    assert [o["meta_info"]["id"] for o in out] == ["multi_0", "multi_1", "multi_2"]


def test_streaming_is_cumulative_sse(ds_engine):
    body = {
        **GEN,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
    }
    with httpx.stream("POST", f"{ds_engine.url}/generate", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 5  # cumulative, as SGLang by default
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert (
        "weight_versions" in chunks[-1]["meta_info"]
        and "weight_versions" not in chunks[0]["meta_info"]
    )
    full = post(ds_engine.url, "/generate", {**body, "stream": False}).json()
    assert full["output_ids"] == chunks[-1]["output_ids"]


def test_abort_request_mid_generation(ds_engine):
    t, box = _background(ds_engine.url, {**LONG, "rid": "to-abort"})
    _wait_running(ds_engine.url)
    r = post(ds_engine.url, "/abort_request", {"rid": "to-abort"})
    assert r.status_code == 200
    t.join()
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 120


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(ds_engine, mode):
    t, box = _background(ds_engine.url, {**LONG, "rid": f"pause-{mode}"})
    _wait_running(ds_engine.url)
    r = post(ds_engine.url, "/pause_generation", {"mode": mode})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    if mode != "abort":
        # the pause ran on the scheduler thread between two steps: from then on the loop
        # turns without stepping
        paused = _info(ds_engine.url)
        later = _wait_loops(ds_engine.url, paused["scheduler_loops"] + 3)
        assert later["paused"] and later["decode_steps"] == paused["decode_steps"]
        if mode == "in_place":  # the request keeps its KV cache; retract drops it
            assert later["running_requests"] == 1 and later["kv_cache_tokens"] > 0
        else:
            assert later["running_requests"] == 0 and later["kv_cache_tokens"] == 0
        assert t.is_alive()
    assert post(ds_engine.url, "/continue_generation").json()["status"] == "ok"
    t.join()
    meta = box["r"].json()["meta_info"]
    if mode == "abort":
        assert meta["finish_reason"]["type"] == "abort"
    else:  # retract recomputes the KV cache and carries on; in_place keeps it
        assert meta["finish_reason"] == {"type": "length", "length": 120}


def test_update_weight_version(ds_engine):
    t, box = _background(ds_engine.url, {**LONG, "rid": "keep-me"})
    _wait_running(ds_engine.url)
    r = post(
        ds_engine.url, "/update_weight_version", {"new_version": "7", "abort_all_requests": False}
    )
    assert r.json()["success"] and r.json()["new_version"] == "7"
    t.join()
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["weight_version"] == "7" and meta["weight_versions"][-1]["version"] == "7"
    # SGLang's default aborts running requests
    t, box = _background(ds_engine.url, LONG)
    _wait_running(ds_engine.url)
    post(ds_engine.url, "/update_weight_version", {"new_version": "8"})
    t.join()
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_info_health_and_cache_endpoints(ds_engine):
    assert httpx.get(f"{ds_engine.url}/health").status_code == 200
    assert httpx.get(f"{ds_engine.url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{ds_engine.url}/model_info").json()
    assert (
        info["is_generation"]
        and info["num_hidden_layers"] == 4
        and info["model_type"] == "deepseek_v3"
    )
    server = httpx.get(f"{ds_engine.url}/server_info").json()
    assert server["enable_return_routed_experts"] is True
    assert post(ds_engine.url, "/flush_cache").status_code == 200


def test_server_info_has_the_fields_sglang_clients_read(ds_engine, tiny_checkpoints):
    """SGLang's server args flattened, internal_states (one per DP rank) and version;
    moerl's live keys beside them; no number this engine does not have."""
    from safetensors import safe_open

    info = httpx.get(f"{ds_engine.url}/server_info").json()
    assert httpx.get(f"{ds_engine.url}/get_server_info").json().keys() == info.keys()
    model = httpx.get(f"{ds_engine.url}/model_info").json()
    assert {k: info[k] for k in model if k != "weight_version"} == {
        k: v for k, v in model.items() if k != "weight_version"
    }
    assert info["version"].startswith("moerl ") and "embedded engine" in info["version"]
    assert info["max_context_length"] == model["context_length"] == 128
    assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
    assert info["disable_radix_cache"] is False and info["skip_tokenizer_init"] is False
    assert info["prefix_cache_max_tokens"] == 65536
    assert info["max_running_requests"] == 64 and info["enable_lora"] is False
    assert info["dtype"] == "float32" and info["incremental_streaming_output"] is False
    assert "max_total_num_tokens" not in info  # no preallocated KV pool to size
    live = ("running_requests", "waiting_requests", "decode_steps", "scheduler_loops")
    for key in (*live, "kv_cache_tokens"):
        assert isinstance(info[key], int), key

    [internal] = info["internal_states"]
    assert internal["effective_max_running_requests_per_dp"] == 64
    assert internal["model_path"] == info["model_path"] and internal["dp_size"] == 1
    with safe_open(str(tiny_checkpoints["deepseek_moe"] / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert internal["memory_usage"]["weight"] == pytest.approx(stored / (1 << 30), abs=1e-3)
    assert internal["memory_usage"]["graph"] == {}


def test_routed_experts_absent_without_the_server_flag(tiny_checkpoints, engine_factory):
    """As SGLang: the key is silently absent; the client turns that into an error."""
    eng = engine_factory(tiny_checkpoints["qwen3_moe"])
    out = post(eng.url, "/generate", {**GEN, "return_routed_experts": True}).json()
    assert "routed_experts" not in out["meta_info"]


def test_api_key_guards_every_endpoint(tiny_checkpoints, engine_factory):
    eng = engine_factory(tiny_checkpoints["qwen3_moe"], api_key="s3cret")
    assert post(eng.url, "/generate", GEN).status_code == 401
    assert httpx.get(f"{eng.url}/model_info").status_code == 401
    assert (
        post(eng.url, "/generate", GEN, headers={"Authorization": "Bearer wrong"}).status_code
        == 401
    )
    ok = post(eng.url, "/generate", GEN, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def _close(a: Any, b: Any) -> bool:
    """Equal structure and values, floats within 1e-4."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) < 1e-4
    return bool(a == b)


def test_incremental_streaming_output_sends_only_what_is_new(tiny_checkpoints):
    """--incremental-streaming-output (SGLang's flag): every chunk holds the tokens, text and
    per-token meta_info lists new since the last one, and they join to the whole answer;
    a batch's sequences are cut each on its own."""
    from moerl.engine.inprocess import InProcessEngine, engine_mounts

    body = {
        "input_ids": [[5, 17, 3, 99], [42, 8]],
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_sampling_mask": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
                            "stream_interval": 2},
    }  # fmt: skip

    async def talk(engine: InProcessEngine) -> tuple[dict, list[str], list[dict]]:
        async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=60) as client:
            info = (await client.get(f"{engine.url}/server_info")).json()
            async with client.stream("POST", f"{engine.url}/generate", json=body) as r:
                lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            whole = await client.post(f"{engine.url}/generate", json={**body, "stream": False})
            return info, lines, whole.json()

    engine = InProcessEngine(tiny_checkpoints["deepseek_moe"], "--incremental-streaming-output")
    try:
        info, lines, whole = asyncio.run(talk(engine))
    finally:
        engine.close()
    assert info["incremental_streaming_output"] is True
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for index, want in enumerate(whole):
        mine = [c for c in chunks if c["index"] == index]
        assert [len(c["output_ids"]) for c in mine] == [2, 2, 2]  # the last one final
        assert mine[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert sum((c["output_ids"] for c in mine), []) == want["output_ids"]
        assert "".join(c["text"] for c in mine) == want["text"]
        for key in ("output_token_logprobs", "output_top_logprobs",
                    "output_token_sampling_mask", "output_token_sampling_logprobs"):  # fmt: skip
            joined = sum((c["meta_info"][key] for c in mine), [])
            assert _close(joined, want["meta_info"][key]), key  # two runs: float noise
        assert mine[-1]["meta_info"]["completion_tokens"] == 6  # a count, not a delta
