"""The embedded engine's OpenAI-compatible routes, driven by the real ``openai`` client and
checked against the same engine's native /generate (greedy: the same tokens, logprobs,
routes and sampling mask) and, where installed, SGLang 0.5.23's own response models."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from sglang_protocol_for_tests import validate_with_sglang

openai = pytest.importorskip("openai")

MAX = 6


@pytest.fixture(scope="module")
def client(ds_engine):
    return openai.OpenAI(base_url=f"{ds_engine.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from moerl.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoints["deepseek_moe"])


def generate(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(ids: list[int], **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX, "temperature": 0}, **extra}


def routes(b64: str, info: dict) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    return flat.reshape(-1, info["num_hidden_layers"], info["num_experts_per_tok"])


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the engine should build: the checkpoint's template, applied here."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


USER = [{"role": "user", "content": "1+2="}]


def test_models_list(client, ds_engine, tiny_checkpoints):
    cards = client.models.list().data
    assert [c.id for c in cards] == [str(tiny_checkpoints["deepseek_moe"])]
    info = httpx.get(f"{ds_engine.url}/model_info").json()
    assert cards[0].model_extra["max_model_len"] == info["context_length"]


def test_completion_greedy_equals_generate(client, model, ds_engine):
    out = client.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=MAX,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ref = generate(ds_engine.url, greedy([5, 6, 7]))
    choice = out.choices[0]
    assert choice.text == ref["text"]
    assert choice.model_extra["token_ids"] == ref["output_ids"]
    assert choice.model_extra["prompt_token_ids"] == [5, 6, 7]
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == len(ref["output_ids"])
    assert out.usage.total_tokens == 3 + len(ref["output_ids"])
    assert out.model_extra["metadata"]["weight_version"] == ref["meta_info"]["weight_version"]


def test_chat_uses_the_checkpoint_template_and_equals_generate(client, model, ds_engine, tokenizer):
    ids = chat_ids(tokenizer, USER)
    assert tokenizer.decode(ids) == "user: 1+2= assistant: "
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_completion_tokens=MAX,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ref = generate(ds_engine.url, greedy(ids))
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["response_token_ids"] == ref["output_ids"]
    assert out.usage.prompt_tokens == len(ids)


def test_streaming_concatenates_to_the_whole(client, model):
    # a seeded sample: the tiny model's greedy text is often empty (ids past the
    # tokenizer's vocabulary decode to nothing)
    kw = {"model": model, "max_tokens": 12, "temperature": 1.0, "seed": 3}
    whole = client.completions.create(prompt="12+3=", **kw).choices[0].text
    assert whole
    chunks = list(
        client.completions.create(
            prompt="12+3=", stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    whole = client.chat.completions.create(messages=USER, **kw).choices[0].message.content
    assert whole
    chunks = list(client.chat.completions.create(messages=USER, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_samples(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        n=3,
        max_tokens=4,
        temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    lengths = [len(c.model_extra["response_token_ids"]) for c in out.choices]
    assert out.usage.completion_tokens == sum(lengths)
    assert out.usage.prompt_tokens == len(out.choices[0].model_extra["prompt_token_ids"])
    out = client.completions.create(
        model=model,
        prompt=["1+1=", "2+2="],
        n=2,
        max_tokens=3,
        temperature=1.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 12


def test_logprobs_equal_generate(client, model, ds_engine, tokenizer):
    out = client.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=MAX, temperature=0, logprobs=2
    )
    ref = generate(
        ds_engine.url,
        greedy([5, 6, 7], return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True),
    )
    lp = out.choices[0].logprobs
    rows = ref["meta_info"]["output_token_logprobs"]
    np.testing.assert_allclose(lp.token_logprobs, [r[0] for r in rows], rtol=0, atol=1e-5)
    assert lp.tokens == [r[2] for r in rows]
    # keyed by token text, as SGLang's: ids outside the tokenizer's vocabulary share ""
    tops = [{t[2]: t[0] for t in row} for row in ref["meta_info"]["output_top_logprobs"]]
    assert [d.keys() for d in lp.top_logprobs] == [d.keys() for d in tops]
    for got, want in zip(lp.top_logprobs, tops):
        np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-5)

    ids = chat_ids(tokenizer, USER)
    out = client.chat.completions.create(
        model=model, messages=USER, max_tokens=MAX, temperature=0, logprobs=True, top_logprobs=2
    )
    ref = generate(
        ds_engine.url,
        greedy(ids, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True),
    )
    content = out.choices[0].logprobs.content
    rows = ref["meta_info"]["output_token_logprobs"]
    np.testing.assert_allclose([t.logprob for t in content], [r[0] for r in rows], atol=1e-5)
    assert [t.token for t in content] == [r[2] for r in rows]
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_rl_extension_fields_equal_generate(client, model, ds_engine, tokenizer):
    info = httpx.get(f"{ds_engine.url}/model_info").json()
    ids = chat_ids(tokenizer, USER)
    ref = generate(
        ds_engine.url,
        greedy(ids, return_logprob=True, return_routed_experts=True, return_sampling_mask=True),
    )
    ref_routes = routes(ref["meta_info"]["routed_experts"], info)
    assert ref_routes.shape[0] == len(ids) + len(ref["output_ids"]) - 1

    # response-level sglext, as SGLang returns it without return_meta_info
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX,
        temperature=0,
        extra_body={
            "return_routed_experts": True,
            "return_input_ids_in_sglext": True,
            "return_output_ids_in_sglext": True,
        },
    )
    ext = out.model_extra["sglext"]
    np.testing.assert_array_equal(routes(ext["routed_experts"], info), ref_routes)
    assert ext["input_ids"] == ids and ext["output_ids"] == [ref["output_ids"]]

    # per-choice meta_info: routes, token ids and the sampling mask of every choice
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX,
        temperature=0,
        logprobs=True,
        extra_body={
            "return_routed_experts": True,
            "return_token_ids": True,
            "return_meta_info": True,
            "return_sampling_mask": True,
        },
    )
    choice = out.choices[0].model_extra
    meta = choice["meta_info"]
    assert "sglext" not in out.model_extra
    np.testing.assert_array_equal(routes(meta["routed_experts"], info), ref_routes)
    assert meta["output_token_sampling_mask"] == ref["meta_info"]["output_token_sampling_mask"]
    assert choice["response_token_ids"] == ref["output_ids"] and choice["prompt_token_ids"] == ids

    # completions: sglext.routed_experts, streaming too (a last chunk with no choices)
    out = client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=MAX,
        temperature=0,
        extra_body={"return_routed_experts": True},
    )
    np.testing.assert_array_equal(
        routes(out.model_extra["sglext"]["routed_experts"], info), ref_routes
    )
    chunks = list(
        client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=MAX,
            temperature=0,
            stream=True,
            extra_body={"return_routed_experts": True},
        )
    )
    ext = [c.model_extra["sglext"] for c in chunks if (c.model_extra or {}).get("sglext")]
    np.testing.assert_array_equal(routes(ext[-1]["routed_experts"], info), ref_routes)


@pytest.mark.parametrize(
    "route, body, words",
    [
        ("completions", {"prompt": [5], "temperature": -1}, ["temperature"]),
        ("completions", {"prompt": ""}, ["prompt", "empty"]),
        ("completions", {"prompt": [5], "max_tokens": 0}, ["max_tokens"]),
        ("completions", {"prompt": [5, 100000]}, ["outside [0, 128)"]),
        ("completions", {"prompt": [5], "suffix": "x"}, ["suffix", "not served"]),
        ("completions", {"prompt": [5], "n": 0}, ["n"]),
        ("completions", {"prompt": [5], "top_p": "high"}, ["top_p", "number"]),
        ("chat/completions", {"messages": []}, ["messages", "empty"]),
        ("chat/completions", {"messages": [{"role": "robot", "content": "a"}]}, ["role"]),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            ["text input", "image_url"],
        ),
        (
            "chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "add"}}]},
            ["tools", "--tool-call-parser"],
        ),
        (
            "chat/completions",
            {"messages": USER, "tool_choice": "required"},
            ["tool_choice", "Tools cannot be empty", "required"],
        ),
        (
            "chat/completions",
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "add"}}],
                "tool_choice": {"type": "function", "function": {"name": "mul"}},
            },
            ["tool_choice", "Tool 'mul' not found in tools list."],
        ),
        (
            "chat/completions",
            {"messages": USER, "return_sampling_mask": True},
            ["return_meta_info"],
        ),
        (
            "chat/completions",
            {"messages": USER, "stream": True, "return_token_ids": True},
            ["return_token_ids", "streaming"],
        ),
        (
            "chat/completions",
            {"messages": USER, "return_hidden_states": True},
            ["return_hidden_states"],
        ),
        ("chat/completions", {"messages": USER, "logit_bias": {"x": 1}}, ["logit_bias"]),
        ("chat/completions", {"messages": USER, "max_tokens": 1000}, ["max_tokens", "128"]),
    ],
)
def test_bad_requests_are_400_naming_the_field(ds_engine, route, body, words):
    r = httpx.post(f"{ds_engine.url}/v1/{route}", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400
    for word in words:
        assert word in err["message"]


def test_the_client_raises_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=USER, temperature=-1)


def _sse_bodies(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_responses_fit_sglangs_models(ds_engine, model):
    """The raw bodies, streamed or not, validate as SGLang's own response models."""
    url, ext = ds_engine.url, {"return_routed_experts": True, "return_token_ids": True}
    comp = {"model": model, "prompt": "1+1=", "max_tokens": 3, "logprobs": 1, **ext}
    chat = {
        "model": model,
        "messages": USER,
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 1,
        "n": 2,
    }
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    payloads = [
        ("ModelList", httpx.get(f"{url}/v1/models").json()),
        ("CompletionResponse", httpx.post(f"{url}/v1/completions", json=comp, timeout=120).json()),
        (
            "ChatCompletionResponse",
            httpx.post(
                f"{url}/v1/chat/completions",
                json={**chat, **ext, "return_meta_info": True},
                timeout=120,
            ).json(),
        ),
    ]
    payloads += [
        ("CompletionStreamResponse", c) for c in _sse_bodies(url, "completions", {**comp, **usage})
    ]
    chunks = _sse_bodies(url, "chat/completions", {**chat, **usage, "return_routed_experts": True})
    payloads += [("ChatCompletionStreamResponse", c) for c in chunks]
    assert any("sglext" in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] > 0
    validate_with_sglang(payloads)


@pytest.fixture(scope="module")
def tool_engine(tiny_checkpoints, engine_factory):
    """An engine that parses tool calls (--tool-call-parser qwen25)."""
    return engine_factory(tiny_checkpoints["qwen3_moe"], "--tool-call-parser", "qwen25")


@pytest.fixture(scope="module")
def tool_client(tool_engine):
    return openai.OpenAI(base_url=f"{tool_engine.url}/v1", api_key="unused", max_retries=0)


def test_tools_with_a_tool_call_parser(tool_engine, tool_client):
    """--tool-call-parser: a request with tools is served (the tiny model writes no call,
    so the answer is plain content); parsing itself is tests/unit/test_engine_tool_calls.py."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    out = tool_client.chat.completions.create(
        model="m", messages=USER, tools=tools, max_tokens=4, temperature=0
    )
    assert out.choices[0].message.tool_calls is None
    assert isinstance(out.choices[0].message.content, str)
    assert httpx.get(f"{tool_engine.url}/server_info").json()["tool_call_parser"] == "qwen25"


# Tools the tiny tokenizer can write (lowercase, digits, `{}[]"_:,. `), with arguments an
# untrained model would never get right unless decoding is constrained.
CALC = {
    "type": "object",
    "properties": {
        "op": {"type": "string", "enum": ["add", "mul"]},
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["op", "x", "ok"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 4}},
    "required": ["text"],
    "additionalProperties": False,
}
CALC_TOOLS = [
    {"type": "function", "function": {"name": "calc", "parameters": CALC}},
    {"type": "function", "function": {"name": "note", "parameters": NOTE}},
]


def _valid_arguments(name: str, arguments: str) -> None:
    """The call's arguments are JSON valid for its tool's schema (checked by hand)."""
    args = json.loads(arguments)
    if name == "calc":
        assert set(args) == {"op", "x", "ok"}, args
        assert args["op"] in ("add", "mul") and isinstance(args["ok"], bool)
        assert isinstance(args["x"], int) and 0 <= args["x"] <= 99
    else:
        assert name == "note" and set(args) == {"text"}, (name, args)
        assert isinstance(args["text"], str) and len(args["text"]) <= 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_forces_a_valid_call(tool_client, seed):
    """The random-init model calls a tool with valid arguments only because the grammar
    makes it (one call at most with parallel_tool_calls=false)."""
    out = tool_client.chat.completions.create(
        model="m",
        messages=USER,
        tools=CALC_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        seed=seed,
        temperature=1.0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _valid_arguments(call.function.name, call.function.arguments)


def test_a_named_tool_choice_calls_that_function(tool_client):
    named = {"type": "function", "function": {"name": "note"}}
    out = tool_client.chat.completions.create(
        model="m",
        messages=USER,
        tools=CALC_TOOLS,
        tool_choice=named,
        parallel_tool_calls=False,  # an untrained model would add calls up to max_tokens
        max_tokens=96,
        n=3,
        seed=7,
        temperature=1.0,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "note"
        _valid_arguments("note", call.function.arguments)

    # streamed: no JSON leaks as content, the calls arrive whole
    chunks = list(
        tool_client.chat.completions.create(
            model="m",
            messages=USER,
            tools=CALC_TOOLS,
            tool_choice=named,
            parallel_tool_calls=False,
            max_tokens=96,
            seed=7,
            temperature=1.0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.function.name for c in calls] == ["note"]
    _valid_arguments("note", calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_keeps_every_sampled_token_in_its_sampling_mask(tool_client):
    """The tool-call grammar is folded into the recorded mask: every sampled token is in
    its position's mask, and the first position allows only the array's ``[``."""
    from moerl.models.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    out = tool_client.chat.completions.create(
        model="m",
        messages=USER,
        tools=CALC_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        seed=3,
        temperature=1.0,
        extra_body={
            "return_meta_info": True,
            "return_sampling_mask": True,
            "return_token_ids": True,
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    ids = choice.model_extra["response_token_ids"]
    masks = choice.model_extra["meta_info"]["output_token_sampling_mask"]
    assert len(masks) == len(ids) > 0
    assert all(token in mask for token, mask in zip(ids, masks, strict=True))
    assert masks[0] == [tok.convert_tokens_to_ids("[")]
    assert all(len(mask) < 100 for mask in masks)  # constrained: never the whole vocabulary


def test_a_forced_call_with_another_output_constraint_is_refused(tool_client):
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        tool_client.chat.completions.create(
            model="m",
            messages=USER,
            tools=CALC_TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    with pytest.raises(openai.BadRequestError, match="Tool 'mul' not found in tools list"):
        tool_client.chat.completions.create(
            model="m",
            messages=USER,
            tools=CALC_TOOLS,
            tool_choice={"type": "function", "function": {"name": "mul"}},
        )
    with pytest.raises(openai.BadRequestError, match="Tools cannot be empty"):
        tool_client.chat.completions.create(model="m", messages=USER, tool_choice="required")


def test_a_client_leaving_a_stream_aborts_its_request(inprocess_engine):
    """As /generate's: the first decode step waits for a queued control action so the
    pause lands while the request runs; the client leaves; only an abort frees it."""
    from engine_http import Http

    http = Http(inprocess_engine.url, timeout=30)
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 120, "ignore_eos": True, "stream": True}
    try:
        with (
            inprocess_engine.first_decode_waits_for_a_control(),
            httpx.stream("POST", f"{http.url}/v1/completions", json=body, timeout=30) as r,
        ):
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")  # its first token: it is running
            assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
            assert http.info()["running_requests"] == 1
        http.wait_for(
            "the request aborted and its KV freed",
            lambda i: i["running_requests"] == 0 and i["kv_cache_tokens"] == 0,
        )
    finally:
        http.post("/continue_generation")


def test_seed_stop_and_echo(client, model, ds_engine):
    kw = {"model": model, "prompt": "1+1=", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    sampled = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == sampled  # sampling_seed
    echoed = client.completions.create(**kw, echo=True).choices[0].text
    assert echoed == "1+1=" + sampled
    # a stop string cuts the text where /generate's does, streamed or not
    assert len(sampled) > 2, sampled
    stop = sampled[1:3]
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7, "stop": [stop]}
    ref = generate(ds_engine.url, {"text": "1+1=", "sampling_params": params})
    assert out.text == ref["text"] == sampled[: sampled.find(stop)]
    assert out.finish_reason == "stop" and out.model_extra["matched_stop"] == stop
    chunks = client.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text


def test_a_trajectory_from_the_openai_route_equals_generates(client, model, ds_engine, tokenizer):
    """An agent's chat call with SGLang's extension fields decodes into the same
    Trajectory (tokens, logprobs, versions, routes, sampling mask) as /generate's."""
    from moerl.rollout.decode import response_from_openai_choice, trajectory_from_response

    info = httpx.get(f"{ds_engine.url}/model_info").json()
    shape = {"num_layers": info["num_hidden_layers"], "topk": info["num_experts_per_tok"]}
    flags = {"routed_experts": True, "sampling_mask": True, **shape}
    ids = chat_ids(tokenizer, USER)
    sampling = {"max_new_tokens": MAX, "temperature": 0}
    ref = generate(
        ds_engine.url,
        greedy(ids, return_logprob=True, return_routed_experts=True, return_sampling_mask=True),
    )
    want = trajectory_from_response(ref, ids, sampling, **flags)
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX,
        temperature=0,
        logprobs=True,
        extra_body={
            "return_meta_info": True,
            "return_token_ids": True,
            "return_routed_experts": True,
            "return_sampling_mask": True,
        },
    )
    response, prompt = response_from_openai_choice(out.choices[0].to_dict())
    got = trajectory_from_response(response, prompt, sampling, **flags)
    np.testing.assert_array_equal(got.prompt_ids, want.prompt_ids)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_allclose(got.response_logprobs, want.response_logprobs, atol=1e-5)
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
    np.testing.assert_array_equal(got.versions, want.versions)
    np.testing.assert_array_equal(got.mask_ids, want.mask_ids)
    np.testing.assert_array_equal(got.mask_offsets, want.mask_offsets)
    assert got.finish_reason == want.finish_reason


def test_the_api_key_guards_the_openai_routes(robust_engine):
    from engine_http import KEY

    url = f"{robust_engine.url}/v1"
    assert openai.OpenAI(base_url=url, api_key=KEY).models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()


def test_chat_takes_prompt_token_ids(client, model, ds_engine, tokenizer):
    """Token in, token out: SGLang's chat ``input_ids`` bypasses the template, so a
    multi-turn agent sends the previous token stream plus the new turn's tokens."""
    ids = chat_ids(tokenizer, USER) + [5, 6]
    out = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=MAX,
        temperature=0,
        extra_body={"input_ids": ids, "return_token_ids": True},
    )
    ref = generate(ds_engine.url, greedy(ids))
    assert out.choices[0].model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["response_token_ids"] == ref["output_ids"]
    cont = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    out = client.chat.completions.create(
        model=model,
        messages=cont,
        max_tokens=2,
        temperature=0,
        extra_body={"continue_final_message": True, "return_prompt_token_ids": True},
    )
    prompt = out.choices[0].model_extra["prompt_token_ids"]
    assert tokenizer.decode(prompt) == "user: 1+2= assistant: 3"
