"""Issue 16, item 1: no request stops the scheduler. Malformed bodies are 400s naming the
field; an error inside a step fails only the requests in it; a scheduler thread that ended
anyway is reported by /health and every request fails fast."""

from __future__ import annotations

import threading

import httpx
import pytest
from engine_http import Http, InProcessEngine

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.mark.parametrize(
    "raw, field",
    [
        ('{"input_ids":[5,6],"sampling_params":{"stop_token_ids":5}}', "stop_token_ids"),
        ('{"input_ids":[5,6],"sampling_params":{"top_k":2.5}}', "sampling_params.top_k"),
        ('{"input_ids":[5,6],"sampling_params":{"stop_token_ids":[[1]]}}', "stop_token_ids"),
        ('{"input_ids":[5,6],"sampling_params":{"temperature":NaN}}', "temperature"),
        ('{"input_ids":[5,6],"sampling_params":{"top_p":-Infinity}}', "top_p"),
        ('{"input_ids":[5,6],"sampling_params":{"temperature":"0.8"}}', "temperature"),
        ('{"input_ids":[5,6],"sampling_params":{"top_k":"5"}}', "sampling_params.top_k"),
        ('{"input_ids":[5,6],"sampling_params":[1]}', "sampling_params"),
        ('{"input_ids":[5,6],"lora_path":["x"]}', "lora_path"),
        ('{"input_ids":[5,true]}', "input_ids"),
        ('{"input_ids":[5,6],"rid":{"a":1}}', "rid"),
        ('{"text":7}', "text"),
        ('{"text":[]}', "text"),  # found by the fuzz test
        ("[" * 5000 + "]" * 5000, "nested"),
    ],
)
def test_malformed_generate_is_400_naming_the_field(http, raw, field):
    r = http.post("/generate", raw=raw, timeout=10)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    assert http.post("/generate", GEN, timeout=10).json()["meta_info"]["completion_tokens"] == 3


def test_refusals_say_what_to_send(http):
    """Found by fuzzing the messages: each names what is wrong and what was meant."""
    r = http.post("/generate", {**GEN, "return_logprob": True, "token_ids_logprob": [3, 500]})
    assert r.status_code == 400 and "[0, 128), got [500]" in r.json()["error"]["message"]
    r = http.post("/destroy_weights_update_group", {"group_name": None})  # null: the default
    assert "'weight_update_group' to destroy (joined: none)" in r.json()["message"]
    r = http.post("/unload_lora_adapter", {})
    assert r.json()["error_message"] == "unload_lora_adapter needs lora_name"


def _generate_in_thread(http: Http, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def go() -> None:
        try:
            box["r"] = http.post("/generate", body)
        except httpx.HTTPError as err:
            box["r"] = err

    thread = threading.Thread(target=go)
    thread.start()
    return thread, box


def test_a_failing_step_fails_only_its_requests(inprocess_engine):
    """A fault inside the model's forward (a torch hook on the real model: a poisoned
    prompt token at prefill, a poisoned position at decode) fails the request it hit with
    a 500 naming it; a request decoding in the same batch finishes."""

    def fault(module, args, kwargs):  # type: ignore[no-untyped-def]
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        if ids.shape[1] > 1 and (ids == 99).any():  # prompts only: 99 may be sampled
            raise RuntimeError("poisoned token")
        if ids.shape[1] == 1 and (pos == 40).any():
            raise RuntimeError("poisoned position")

    model = inprocess_engine.state.runner.model
    handle = model.register_forward_pre_hook(fault, with_kwargs=True)
    http = Http(inprocess_engine.url, timeout=30)
    # a cached [5, ...] would leave [99] a one-token prefill, which the fault takes for decode
    assert http.post("/flush_cache").status_code == 200
    try:
        r = http.post("/generate", {**GEN, "input_ids": [5, 99]})
        assert r.status_code == 500 and "prefill failed: RuntimeError: poisoned token" in r.text
        long = {
            "input_ids": list(range(5, 43)),  # positions 0..37; decode reaches 40
            "sampling_params": {"max_new_tokens": 10, "ignore_eos": True},
        }
        short = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        t_long, box_long = _generate_in_thread(http, long)
        t_short, box_short = _generate_in_thread(http, short)
        t_long.join(), t_short.join()
        assert box_long["r"].status_code == 500
        assert "decode failed: RuntimeError: poisoned position" in box_long["r"].text
        assert box_short["r"].status_code == 200
        assert box_short["r"].json()["meta_info"]["completion_tokens"] == 8
        info = http.info()
        assert info["failed_requests"] == 2 and info["scheduler_error"] is None
        assert http.get("/health").status_code == 200
    finally:
        handle.remove()
    assert http.post("/generate", GEN).status_code == 200


@pytest.fixture()
def doomed_engine(tiny_checkpoints):  # type: ignore[no-untyped-def]
    eng = InProcessEngine(tiny_checkpoints["qwen3_moe"])
    yield eng
    eng.close()


def test_a_dead_scheduler_is_reported_and_requests_fail_fast(doomed_engine):
    """However the scheduler thread ends (here a control action raising SystemExit), the
    request waiting in it, later requests, control calls and the health checks answer at
    once with the reason instead of hanging."""
    inprocess_engine = doomed_engine
    http = Http(inprocess_engine.url, timeout=10)
    assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    waiting, box = _generate_in_thread(http, GEN)
    http.wait_for("one request waiting", lambda i: i["waiting_requests"] == 1)

    def die() -> None:
        raise SystemExit("injected")

    inprocess_engine.state.scheduler.control(die, lambda *_: None)
    waiting.join()
    assert box["r"].status_code == 503 and "SystemExit: injected" in box["r"].text
    health = http.get("/health")
    assert health.status_code == 503
    assert "scheduler thread died: SystemExit: injected" in health.json()["message"]
    assert http.post("/generate", GEN).status_code == 503
    assert http.post("/continue_generation").status_code == 503
    assert http.get("/health_generate").status_code == 503
    assert http.info()["scheduler_error"].startswith("the scheduler thread died")


def test_validation_accepts_sglang_batch_and_null_forms():
    """The checks are types, not features: SGLang's batch forms and nulls pass them (the
    request parser decides what the engine serves)."""
    from moerl.engine.validate import RequestError, check_generate

    batch = {
        "input_ids": [[5, 6], [7]],
        "sampling_params": [{"temperature": None}, {"top_k": 3}],
        "lora_path": ["a", None],
        "rid": ["r0", "r1"],
    }
    assert check_generate(batch)["sampling_params"] == [{}, {"top_k": 3}]
    assert check_generate({"text": ["a", "b"], "sampling_params": {"max_new_tokens": None}})
    with pytest.raises(RequestError, match=r"sampling_params\[1\]\.top_k"):
        check_generate({**batch, "sampling_params": [{}, {"top_k": 1.5}]})
    with pytest.raises(RequestError, match="lora_path"):
        check_generate({"input_ids": [5], "lora_path": ["a"]})
    with pytest.raises(RequestError, match="text"):  # never half batch
        check_generate({"input_ids": [5], "text": ["a"], "lora_path": ["a"]})


def test_freeze_gc_moves_the_engines_objects_out_of_the_collectors_scans(inprocess_engine):
    """SGLang's /freeze_gc (GET and POST, its answer): the engine collects, then every
    object alive, its model's modules included, sits in the collector's permanent
    generation (here the engine shares this process, so this process's count is the
    engine's); it still generates after."""
    import gc

    http = Http(inprocess_engine.url, timeout=30)
    model = inprocess_engine.state.runner.model

    def scanned() -> bool:  # gc.get_objects lists generations 0-2, not the permanent one
        return any(o is model for o in gc.get_objects())

    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0 and scanned()
        r = http.post("/freeze_gc")
        assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 and not scanned()  # torch's, transformers', the engine's
        assert http.get("/freeze_gc").status_code == 200  # again: what was made since
        assert gc.get_freeze_count() > 10_000 and not scanned()
    finally:
        gc.unfreeze()
    assert http.post("/generate", GEN).status_code == 200
