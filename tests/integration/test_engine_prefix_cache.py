"""The engine's prefix cache: a request extending a finished one reuses its KV and routes,
and answers exactly as an engine that prefills everything (--disable-radix-cache)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from engine_http import Http, InProcessEngine, WeightTrainer, checkpoint_tensors
from safetensors.torch import save

FLAGS = ("--enable-return-routed-experts", "--enable-lora", "--max-lora-rank", "4")
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 120, size=40)]
NEW = [7, 8, 9, 10, 11, 12]  # the next turn's observation


@pytest.fixture(scope="module")
def pair(tiny_checkpoints) -> Iterator[tuple[Http, Http]]:
    """The same model with the prefix cache on and off, in this process."""
    model = tiny_checkpoints["qwen3_moe"]
    on = InProcessEngine(model, *FLAGS)
    off = InProcessEngine(model, *FLAGS, "--disable-radix-cache")
    yield Http(on.url), Http(off.url)
    on.close()
    off.close()


@pytest.fixture()
def cached(pair) -> Http:
    """The cache-on engine, emptied."""
    assert pair[0].post("/flush_cache").status_code == 200
    return pair[0]


def generate(http: Http, ids: list[int], new: int = 8, **extra) -> dict:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
        **extra,
    }
    r = http.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def routes(http: Http, out: dict) -> np.ndarray:
    info = http.get("/model_info").json()
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    shape = (-1, info["num_hidden_layers"], info["num_experts_per_tok"])
    return np.frombuffer(raw, dtype=np.int32).reshape(shape)


def same(http_a: Http, a: dict, http_b: Http, b: dict) -> None:
    """Same tokens, logprobs to 1e-5 (input and output) and routes."""
    assert a["output_ids"] == b["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        got, want = a["meta_info"][key], b["meta_info"][key]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        for (x, _, _), (y, _, _) in zip(got, want):
            assert (x is None and y is None) or abs(x - y) < 1e-5, (key, x, y)
    np.testing.assert_array_equal(routes(http_a, a), routes(http_b, b))


def next_turn(first: dict) -> list[int]:
    return PROMPT + first["output_ids"] + NEW


def test_next_turn_reuses_the_finished_turn_and_answers_as_without_cache(pair, cached):
    on, off = pair
    first = generate(cached, PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    ids = next_turn(first)
    got, want = generate(cached, ids), generate(off, ids)
    # every token the first turn processed: the prompt and its output but the last
    assert got["meta_info"]["cached_tokens"] == len(PROMPT) + 8 - 1
    assert want["meta_info"]["cached_tokens"] == 0
    same(on, got, off, want)
    # Keep Routing across turns: the first turn's rows, as the engine first chose them
    np.testing.assert_array_equal(routes(on, got)[: len(PROMPT) + 7], routes(on, first))
    assert on.info()["disable_radix_cache"] is False and off.info()["disable_radix_cache"]


def test_seeded_sampling_and_a_routes_window_match_without_cache(pair, cached):
    on, off = pair
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    first = generate(cached, PROMPT, sampling_params=sampling)
    ids = next_turn(first)
    window = {"sampling_params": sampling, "routed_experts_start_len": len(PROMPT)}
    got, want = generate(cached, ids, **window), generate(off, ids, **window)
    assert got["meta_info"]["cached_tokens"] > 0
    same(on, got, off, want)


def test_flush_cache_forgets(pair, cached):
    first = generate(cached, PROMPT)
    for method in ("get", "post"):
        assert getattr(cached, method)("/flush_cache").status_code == 200
        assert cached.info()["prefix_cache_tokens"] == 0
        again = generate(cached, next_turn(first))
        assert again["meta_info"]["cached_tokens"] == 0
        same(cached, again, pair[1], generate(pair[1], next_turn(first)))


def test_input_logprobs_limit_reuse_to_logprob_start_len(pair, cached):
    on, off = pair
    first = generate(cached, PROMPT)
    ids = next_turn(first)
    start = len(PROMPT) - 10
    got = generate(cached, ids, logprob_start_len=start)
    want = generate(off, ids, logprob_start_len=start)
    assert got["meta_info"]["cached_tokens"] == start
    assert len(got["meta_info"]["input_token_logprobs"]) == len(ids) - start
    same(on, got, off, want)


def _adapter_body(http: Http, name: str, seed: int) -> dict:
    """A random PEFT adapter on q_proj of every layer, as /load_lora_adapter_from_tensors."""
    info = http.get("/model_info").json()
    gen = torch.Generator().manual_seed(seed)
    hidden, q_out = 64, 4 * 16
    tensors = {}
    for layer in range(info["num_hidden_layers"]):
        module = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{module}.lora_A.weight"] = torch.randn(4, hidden, generator=gen)
        tensors[f"{module}.lora_B.weight"] = torch.randn(q_out, 4, generator=gen)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    blob = base64.b64encode(save(tensors)).decode()
    return {"lora_name": name, "config_dict": config, "safetensors_b64": blob}


def test_adapters_do_not_share_and_a_reload_forgets(cached):
    for name, seed in (("a", 1), ("b", 2)):
        r = cached.post("/load_lora_adapter_from_tensors", _adapter_body(cached, name, seed))
        assert r.json()["success"], r.text
    first = generate(cached, PROMPT, lora_path="a")
    ids = next_turn(first)
    assert generate(cached, ids)["meta_info"]["cached_tokens"] == 0  # base model
    assert generate(cached, ids, lora_path="b")["meta_info"]["cached_tokens"] == 0
    assert generate(cached, ids, lora_path="a")["meta_info"]["cached_tokens"] > 0
    # "a" replaced under the same name: its cached KV was the old adapter's
    assert cached.post("/unload_lora_adapter", {"lora_name": "a"}).json()["success"]
    r = cached.post("/load_lora_adapter_from_tensors", _adapter_body(cached, "a", 3))
    assert r.json()["success"], r.text
    assert generate(cached, ids, lora_path="a")["meta_info"]["cached_tokens"] == 0
    # the base model's entry from above is untouched by the adapter's reload
    assert generate(cached, ids + [5])["meta_info"]["cached_tokens"] > 0


def test_lru_keeps_within_the_token_budget(tiny_checkpoints):
    eng = InProcessEngine(
        tiny_checkpoints["qwen3_moe"], "--enable-return-routed-experts",
        "--prefix-cache-max-tokens", "100",
    )  # fmt: skip
    http = Http(eng.url)
    try:
        prompts = [[3 + i, *PROMPT[:30]] for i in range(3)]  # 30 + 1 + 8 - 1 = 38 each
        firsts = [generate(http, p) for p in prompts]
        info = http.info()
        assert info["prefix_cache_tokens"] == 76 and info["prefix_cache_sequences"] == 2
        # the oldest went first; the other two are reused (newest first: each hit's
        # longer sequence then evicts the least recently used)
        hits = [generate(http, prompts[i] + firsts[i]["output_ids"] + NEW) for i in (2, 1, 0)]
        assert [h["meta_info"]["cached_tokens"] for h in hits] == [38, 38, 0]
        assert http.info()["prefix_cache_tokens"] <= 100
    finally:
        eng.close()


def test_weight_update_flushes(tiny_checkpoints, engine_factory, tmp_path_factory):
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    new = save_tiny_checkpoint(
        tiny_config("qwen3_moe"), tmp_path_factory.mktemp("w") / "hf", seed=1
    )
    engine = Http(engine_factory(tiny_checkpoints["qwen3_moe"], *FLAGS[:1]).url)
    fresh = Http(engine_factory(new, *FLAGS[:1], "--disable-radix-cache").url)
    first = generate(engine, PROMPT)
    assert generate(engine, next_turn(first))["meta_info"]["cached_tokens"] > 0
    # flush_cache=false in the body: the embedded engine flushes anyway
    result = WeightTrainer(engine.url).send(checkpoint_tensors(new), "1", bucketed=True)
    assert result["success"], json.dumps(result)
    got = generate(engine, next_turn(first))
    assert got["meta_info"]["cached_tokens"] == 0
    same(engine, got, fresh, generate(fresh, next_turn(first)))


def test_a_group_prefills_its_prompt_once_and_answers_as_without_cache(pair, cached):
    """Four samples of one prompt in one batch (a GRPO group): the first prefills the
    prompt, the others, admitted with it, copy all of it (KV, routes and the logits of
    its last token), and every answer equals the cache-off engine's."""
    on, off = pair
    body = {
        "input_ids": [PROMPT] * 4,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    got, want = cached.post("/generate", body).json(), off.post("/generate", body).json()
    cached_tokens = sorted(g["meta_info"]["cached_tokens"] for g in got)
    assert cached_tokens == [0] + [len(PROMPT)] * 3
    # without the cache the group's prompt is still prefilled once, and none counts as
    # cached (as SGLang reports with --disable-radix-cache)
    assert [w["meta_info"]["cached_tokens"] for w in want] == [0] * 4
    for g, w in zip(got, want):
        same(on, g, off, w)
