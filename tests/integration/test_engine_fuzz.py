"""Property-based fuzzing of the engine's HTTP API (issue 16): random JSON bodies for
/generate and every control endpoint, shaped like the real ones often enough to reach deep
code. Every answer is 2xx, 4xx or 503, within a client-side timeout and a size bound,
errors are JSON, a refused /generate body names the field it refuses; afterwards /health
is 200 and a valid request succeeds.

Seeded (derandomize) and bounded: ~20 s in the default suite, ``-m slow`` runs longer."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moerl.engine.validate import SAMPLING

TIMEOUT_S = 30.0
MAX_BODY = 1 << 20  # a response (or stream event)
MAX_ERROR = 1 << 14  # an error's JSON

leaf = (
    st.none()
    | st.booleans()
    | st.integers(-5, 140)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
anything = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-2, 130), max_size=6)
prompt = st.lists(st.integers(0, 127), min_size=1, max_size=6)  # in the tiny vocab
small = st.integers(0, 6)

PLAUSIBLE_SAMPLING = {  # max_new_tokens is always there, and small
    "temperature": st.floats(0, 3) | st.sampled_from([0, 1]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 200).filter(bool),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "min_new_tokens": st.integers(0, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_regex": st.sampled_from(["a", "[0-9]+", "x$", "(", "a{2}"]),
    "regex": st.sampled_from(["[0-9]{1,3}", "(yes|no)", "(", ""]),
    "json_schema": st.sampled_from(['{"type": "integer"}', "{", '{"type": "bogus"}']),
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "root ::=", ""]),
    "logit_bias": st.dictionaries(st.sampled_from(["3", "7", "-1", "x"]), st.floats(-5, 5)),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "stream_interval": st.integers(0, 3),
    "sampling_seed": st.integers(-3, 2**64),
}
PLAUSIBLE_GENERATE = {
    "text": st.text(max_size=10),
    "sampling_params": st.fixed_dictionaries(
        {"max_new_tokens": small}, optional=PLAUSIBLE_SAMPLING
    ),
    "rid": st.text(max_size=8),
    "stream": st.booleans(),
    "return_logprob": st.booleans(),
    "lora_path": st.just(""),
    "return_routed_experts": st.booleans(),
    "routed_experts_start_len": st.integers(0, 1),
    "return_sampling_mask": st.booleans(),
    "sampling_logprobs_mode": st.sampled_from(["selected", "support"]),
    "logprob_start_len": st.integers(-2, 7),
    "top_logprobs_num": st.integers(-1, 5),
    "token_ids_logprob": token_ids,
    "return_text_in_logprobs": st.booleans(),
}
plausible_generate = st.fixed_dictionaries(
    {"input_ids": prompt | token_ids | st.lists(prompt, max_size=3)}, optional=PLAUSIBLE_GENERATE
)


def _mutated(plausible: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """A plausible (mostly valid) body with one field, maybe a sampling one, set to
    anything."""
    return st.tuples(plausible, st.sampled_from(keys), anything).map(
        lambda t: _set(t[0], t[1], t[2])
    )


def _set(body: dict, key: str, value: object) -> dict:
    body = dict(body)
    if key.startswith("sampling_params."):
        params = body.get("sampling_params")
        body["sampling_params"] = {**(params if isinstance(params, dict) else {}), key[16:]: value}
    else:
        body[key] = value
    return body


GENERATE_KEYS = ["input_ids", *PLAUSIBLE_GENERATE, *(f"sampling_params.{k}" for k in SAMPLING)]
generate_body = st.one_of(
    plausible_generate,
    _mutated(plausible_generate, GENERATE_KEYS),
    _mutated(plausible_generate, GENERATE_KEYS),
    st.dictionaries(st.sampled_from(GENERATE_KEYS[: len(PLAUSIBLE_GENERATE) + 1]), anything),
)


def _plausible(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={k: v | anything for k, v in fields.items()})


CONTROL = {
    "/pause_generation": _plausible({"mode": st.sampled_from(["abort", "retract", "in_place"])}),
    "/continue_generation": anything,
    "/abort_request": _plausible({"rid": st.text(max_size=4), "abort_all": st.booleans()}),
    "/flush_cache": anything,
    "/update_weight_version": _plausible(
        {"new_version": st.text(max_size=4), "abort_all_requests": st.booleans()}
    ),
    "/init_weights_update_group": _plausible(
        {
            "master_address": st.just("127.0.0.1"),
            "master_port": st.integers(-1, 70000),
            "rank_offset": st.integers(-2, 3),
            "world_size": st.integers(-1, 3),
            "backend": st.sampled_from(["gloo", "nccl", "mpi"]),
        }
    ),
    "/destroy_weights_update_group": _plausible({"group_name": st.text(max_size=4)}),
    "/begin_weight_update": _plausible({"selector": st.sampled_from(["target", "all", "x"])}),
    "/end_weight_update": anything,
    "/update_weights_from_tensor": _plausible(
        {
            "serialized_named_tensors": st.lists(st.text(max_size=8), max_size=2),
            "load_format": st.sampled_from(["direct", "flattened_bucket", "npz"]),
        }
    ),
    "/update_weights_from_distributed": _plausible(
        {
            "names": st.lists(st.sampled_from(["model.norm.weight", "x"]), max_size=2),
            "dtypes": st.lists(st.sampled_from(["float32", "bfloat16", "nope"]), max_size=2),
            "shapes": st.lists(st.lists(st.integers(-2, 70), max_size=2), max_size=2),
            "group_name": st.text(max_size=4),
        }
    ),
    "/load_lora_adapter": _plausible(
        {"lora_name": st.text(max_size=4), "lora_path": st.sampled_from(["/", "/nonexistent"])}
    ),
    "/load_lora_adapter_from_tensors": _plausible(
        {
            "lora_name": st.text(max_size=4),
            "config_dict": _plausible({"r": small, "lora_alpha": st.floats()}),
            "safetensors_b64": st.text(max_size=16),
        }
    ),
    "/unload_lora_adapter": _plausible({"lora_name": st.text(max_size=4)}),
}


def _would_join_a_group(path: str, body: object) -> bool:
    """A well-formed group join would wait on a store no one runs: not a fuzz case."""
    if path != "/init_weights_update_group" or not isinstance(body, dict):
        return False
    rank, world = body.get("rank_offset"), body.get("world_size")
    ints = all(type(body.get(k)) is int for k in ("master_port", "rank_offset", "world_size"))
    return (
        ints
        and isinstance(body.get("master_address"), str)
        and body.get("backend") in (None, "gloo")
        and 0 <= rank < world
        and 1 <= body["master_port"] <= 65535
    )


def _check(r: httpx.Response, stream: bool = False) -> None:
    assert r.status_code < 300 or 400 <= r.status_code < 500 or r.status_code == 503, (
        r.status_code,
        r.text[:2000],
    )
    if r.status_code >= 400:
        assert len(r.content) <= MAX_ERROR and isinstance(r.json(), dict), r.text[:2000]
    elif stream:  # each event is one JSON response; events repeat the output so far
        events = r.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], r.text[-2000:]
        assert all(len(e) <= MAX_BODY and json.loads(e[6:]) for e in events[:-2])
    else:
        assert len(r.content) <= MAX_BODY


def _names_a_field(body: object, r: httpx.Response) -> None:
    """A refused /generate body is refused by name: the message names one of its fields
    (a sampling parameter's own name counts), or the prompt it lacks."""
    if not 400 <= r.status_code < 500 or not isinstance(body, dict):
        return
    answer = r.json()
    error = answer.get("error")
    message = error["message"] if isinstance(error, dict) else str(answer)
    keys = {str(k) for k in body} | {"input_ids", "text", "request body"}
    params = body.get("sampling_params")
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict):
            keys |= {str(k) for k in one}
    assert any(k and k in message for k in keys), (message, body)


def _send(http, path: str, body: object) -> None:  # type: ignore[no-untyped-def]
    # allow_nan: Python's json writes NaN/Infinity, which the engine must refuse cleanly
    raw = json.dumps(body, allow_nan=True)
    if path == "/generate" and isinstance(body, dict) and body.get("stream") is True:
        with httpx.stream(
            "POST",
            f"{http.url}{path}",
            content=raw,
            headers={**http.headers, "content-type": "application/json"},
            timeout=TIMEOUT_S,
        ) as r:
            r.read()
        _check(r, stream=True)
    else:
        r = http.post(path, raw=raw, timeout=TIMEOUT_S)
        _check(r)
    if path == "/generate":
        _names_a_field(body, r)


def _fuzz(http, examples: int) -> None:  # type: ignore[no-untyped-def]
    requests = st.one_of(
        st.tuples(st.just("/generate"), generate_body),
        st.tuples(st.just("/generate"), generate_body),
        st.tuples(st.sampled_from([*CONTROL, "/generate"]), anything),
        st.sampled_from(sorted(CONTROL)).flatmap(lambda p: st.tuples(st.just(p), CONTROL[p])),
    ).filter(lambda pb: not _would_join_a_group(*pb))

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(requests)
    def one(request: tuple[str, object]) -> None:
        path, body = request
        try:
            _send(http, path, body)
        finally:  # a fuzzed pause must not stall the next example
            if path == "/pause_generation":
                _check(http.post("/continue_generation"))

    one()
    _check(http.post("/generate", raw="{not json", timeout=TIMEOUT_S))
    assert http.get("/health").status_code == 200
    ok = http.post(
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    )
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    assert http.info()["scheduler_error"] is None
    assert not math.isnan(http.info()["last_step_s"])


def test_fuzz_every_endpoint(http):
    _fuzz(http, examples=60)


@pytest.mark.slow
def test_fuzz_every_endpoint_long(http):
    _fuzz(http, examples=3000)
