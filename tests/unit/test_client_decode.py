"""Engine client: decoding of SGLang-format responses, request bodies, retries and balancing.

Responses are hand-built in SGLang 0.5.23's exact wire format. The retry / balancing /
broadcast tests fake the network with httpx.MockTransport (scripted HTTP answers, no server);
they test the client's own logic only. Real client <-> engine conformance lives in
tests/**/test_engine*.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest

from moerl.rollout.client import ENGINE_URL_KEY, EngineClient, build_generate_body
from moerl.rollout.decode import (
    decode_routed_experts,
    sampling_mask_to_csr,
    trajectory_from_response,
    versions_from_spans,
)
from moerl.rollout.errors import EngineError, RoutedExpertsMissing, SamplingMaskMissing

A, B = "http://engine-a:30000", "http://engine-b:30000"
PROMPT = [11, 12, 13]
# P=3, R=3 -> 5 routed rows; L=2 layers (layer 0 dense: zeros), K=2; ids unsorted as SGLang
ROUTES_TLK = np.array(
    [[[0, 0], [5, 2]], [[0, 0], [1, 7]], [[0, 0], [6, 3]], [[0, 0], [2, 0]], [[0, 0], [4, 5]]],
    dtype=np.int32,
)


def sglang_b64(arr: np.ndarray) -> str:
    """What SGLang's detokenizer sends: pybase64.b64encode(tensor.numpy().tobytes())."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.int32).tobytes()).decode()


def sglang_response(**meta_overrides) -> dict:
    meta = {
        "id": "rid-1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "weight_version": "4",
        "weight_versions": [
            {"version": "3", "start": 0, "end": 1},
            {"version": "4", "start": 1, "end": 3},
        ],
        "output_token_logprobs": [[-0.5, 21, None], [-1.5, 22, None], [-0.25, 2, None]],
        "routed_experts": sglang_b64(ROUTES_TLK),
        "output_token_sampling_mask": [[21, 30], [40, 22, 41], [2]],
        "output_token_sampling_logprobs": [-0.1, -0.9, 0.0],
        "output_token_sampling_mask_length": 3,
    }
    meta.update(meta_overrides)
    meta = {k: v for k, v in meta.items() if v is not None}
    return {"text": "abc", "output_ids": [21, 22, 2], "meta_info": meta}


# ---- pure decoding --------------------------------------------------------------------------


def test_routed_experts_base64_decodes_to_the_array_unsorted():
    got = decode_routed_experts(sglang_b64(ROUTES_TLK), rows=5, num_layers=2, topk=2)
    assert got.dtype == np.int32 and np.array_equal(got, ROUTES_TLK)
    # either dimension is inferred from the byte count
    assert decode_routed_experts(sglang_b64(ROUTES_TLK), rows=5, topk=2).shape == (5, 2, 2)
    assert decode_routed_experts(sglang_b64(ROUTES_TLK), rows=5, num_layers=2).shape == (5, 2, 2)


def test_routed_experts_wrong_size_is_an_engine_error():
    with pytest.raises(EngineError, match="holds 20 ids, expected rows"):
        decode_routed_experts(sglang_b64(ROUTES_TLK), rows=4, num_layers=2, topk=2)
    with pytest.raises(EngineError, match="not valid base64"):
        decode_routed_experts("!!!", rows=1, num_layers=1, topk=1)


def test_weight_version_spans_become_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    got = versions_from_spans(spans, 5)
    assert got.dtype == np.int32 and got.tolist() == [3, 3, 5, 5, 5]
    assert versions_from_spans([], 3, fallback="7").tolist() == [7, 7, 7]
    assert versions_from_spans([{"version": "2", "start": 0, "end": 0}], 0).tolist() == []


def test_bad_versions_are_engine_errors():
    with pytest.raises(EngineError, match="leave output token 2 without a version"):
        versions_from_spans([{"version": "1", "start": 0, "end": 2}], 3)
    with pytest.raises(EngineError, match="outside the 2 output tokens"):
        versions_from_spans([{"version": "1", "start": 0, "end": 3}], 2)
    with pytest.raises(EngineError, match="--weight-version 0"):
        versions_from_spans(None, 2, fallback="default")


def test_sampling_mask_lists_become_csr():
    ids, offsets = sampling_mask_to_csr([[5, 1], [], [7, 8, 9]])
    assert ids.dtype == np.int32 and ids.tolist() == [5, 1, 7, 8, 9]
    assert offsets.dtype == np.int32 and offsets.tolist() == [0, 2, 2, 5]
    ids, offsets = sampling_mask_to_csr([])
    assert ids.tolist() == [] and offsets.tolist() == [0]


def test_response_decodes_into_a_trajectory():
    traj = trajectory_from_response(
        sglang_response(),
        PROMPT,
        {"temperature": 0.8, "top_k": 50},
        routed_experts=True,
        sampling_mask=True,
        num_layers=2,
        topk=2,
        group_id="g",
        index=2,
        url=A,
    )
    traj.validate(num_layers=2, topk=2, num_experts=8)
    assert traj.prompt_ids.tolist() == PROMPT and traj.response_ids.tolist() == [21, 22, 2]
    assert traj.response_logprobs.tolist() == [-0.5, -1.5, -0.25]
    assert traj.versions.tolist() == [3, 4, 4]
    assert np.array_equal(traj.routed_experts, ROUTES_TLK)
    assert traj.mask_ids.tolist() == [21, 30, 40, 22, 41, 2]
    assert traj.mask_offsets.tolist() == [0, 2, 5, 6]
    assert traj.sampling_logprobs.dtype == np.float32
    assert traj.sampling_logprobs.tolist() == pytest.approx([-0.1, -0.9, 0.0])
    assert (traj.temperature, traj.finish_reason) == (pytest.approx(0.8), "stop")
    assert (traj.group_id, traj.index) == ("g", 2)
    assert traj.meta["rid"] == "rid-1" and traj.meta["engine_url"] == A


def test_greedy_temperature_is_reported_as_sglang_applies_it():
    traj = trajectory_from_response(sglang_response(), PROMPT, {"temperature": 0.0})
    assert traj.temperature == 1.0
    assert trajectory_from_response(sglang_response(), PROMPT, {}).temperature == 1.0


def test_missing_routed_experts_never_yields_a_trajectory():
    with pytest.raises(RoutedExpertsMissing, match="--enable-return-routed-experts") as err:
        trajectory_from_response(
            sglang_response(routed_experts=None), PROMPT, {}, routed_experts=True, topk=2, url=A
        )
    assert err.value.urls == [A]


def test_missing_sampling_mask_is_reported():
    with pytest.raises(SamplingMaskMissing, match="return_sampling_mask"):
        trajectory_from_response(
            sglang_response(output_token_sampling_mask=None), PROMPT, {}, sampling_mask=True
        )


def test_inconsistent_logprobs_are_engine_errors():
    bad = [[-0.5, 21, None], [-1.5, 99, None], [-0.25, 2, None]]
    with pytest.raises(EngineError, match=r"output_token_logprobs\[1\] is for token 99"):
        trajectory_from_response(sglang_response(output_token_logprobs=bad), PROMPT, {})
    with pytest.raises(EngineError, match="2 entries for 3 output ids"):
        trajectory_from_response(sglang_response(output_token_logprobs=bad[:2]), PROMPT, {})


def test_aborted_partial_rollout_keeps_its_tokens():
    response = sglang_response(
        finish_reason={"type": "abort", "message": "Abort in waiting queue", "status_code": None}
    )
    traj = trajectory_from_response(response, PROMPT, {})
    assert traj.finish_reason == "abort" and traj.response_len == 3


@pytest.mark.parametrize("routes", [None, ""])
def test_a_request_aborted_before_its_first_token_needs_no_routes(routes):
    """An engine restarted and paused meanwhile aborts a request that never ran: no
    tokens and no routes (missing, or moerl.engine's empty list). That is a trajectory to
    start again (moerl.rollout.partial), not a broken response."""
    response = sglang_response(
        finish_reason={"type": "abort", "message": "Abort in waiting queue"},
        output_token_logprobs=[], routed_experts=routes, output_token_sampling_mask=[],
        output_token_sampling_logprobs=[], weight_versions=[],
    )  # fmt: skip
    response["output_ids"] = []
    traj = trajectory_from_response(
        response, PROMPT, {}, routed_experts=True, sampling_mask=True, num_layers=2, topk=2
    )
    assert traj.finish_reason == "abort" and traj.response_len == 0
    assert traj.routed_experts is None
    # once a token was sampled, the routes are required as always
    started = sglang_response(finish_reason={"type": "abort"}, routed_experts=routes)
    with pytest.raises((RoutedExpertsMissing, EngineError)):
        trajectory_from_response(started, PROMPT, {}, routed_experts=True, num_layers=2, topk=2)


def test_generate_body_leaves_unset_fields_to_the_server():
    body = build_generate_body(np.array(PROMPT, dtype=np.int32), {"max_new_tokens": 4})
    assert body == {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4},
        "return_logprob": True,
        "stream": False,
    }
    full = build_generate_body(
        PROMPT,
        {},
        return_routed_experts=True,
        routed_experts_start_len=0,
        return_sampling_mask=True,
        sampling_logprobs_mode="selected",
        logprob_start_len=1,
        rid="r",
        lora_path="adapter",
    )
    assert full["routed_experts_start_len"] == 0 and full["sampling_logprobs_mode"] == "selected"
    assert full["rid"] == "r" and full["lora_path"] == "adapter" and full["logprob_start_len"] == 1
    with pytest.raises(ValueError, match="needs return_sampling_mask"):
        build_generate_body(PROMPT, {}, sampling_logprobs_mode="selected")
    with pytest.raises(ValueError, match="non-empty 1-D"):
        build_generate_body([[1, 2]], {})


# ---- network behaviour over httpx.MockTransport ---------------------------------------------


def run(coro):
    return asyncio.run(coro)


def client_with(handler, urls=(A, B), **kwargs) -> EngineClient:
    kwargs.setdefault("retry_backoff_s", 0.0)
    return EngineClient(list(urls), transport=httpx.MockTransport(handler), **kwargs)


def base(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}:{request.url.port}"


def test_connection_refused_fails_over_to_the_next_engine():
    calls = []

    def handler(request):
        calls.append(base(request))
        if base(request) == A:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=sglang_response())

    async def go():
        async with client_with(handler) as client:
            traj = await client.generate_trajectory(
                PROMPT, {"max_new_tokens": 3}, routed_experts=True, num_layers=2, topk=2
            )
            # A is cooling down now: the next request goes straight to B
            await client.generate(PROMPT, {})
            return traj, client.outstanding

    traj, outstanding = run(go())
    assert calls == [A, B, B]
    assert traj.meta["engine_url"] == B and np.array_equal(traj.routed_experts, ROUTES_TLK)
    assert outstanding == {A: 0, B: 0}


def test_5xx_is_retried_elsewhere_but_4xx_is_not():
    calls = []

    def handler(request):
        calls.append(base(request))
        if base(request) == A:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return httpx.Response(
            400, json={"error": "unknown field `top_kk`, expected one of `max_new_tokens`"}
        )

    async def go():
        async with client_with(handler) as client:
            await client.generate(PROMPT, {"top_kk": 3})

    with pytest.raises(EngineError, match="HTTP 400: unknown field `top_kk`") as err:
        run(go())
    assert err.value.status_code == 400 and err.value.urls == [B]
    assert calls == [A, B]


def test_dead_engines_give_a_clear_error_after_retries():
    calls = []

    def handler(request):
        calls.append(base(request))
        raise httpx.ConnectError("connection refused", request=request)

    async def go():
        async with client_with(handler, max_retries=3) as client:
            await client.generate(PROMPT, {})

    with pytest.raises(EngineError) as err:
        run(go())
    msg = str(err.value)
    assert len(calls) == 4 and set(calls) == {A, B}
    assert A in msg and B in msg and "ConnectError" in msg and "engine.urls" in msg
    assert err.value.urls == [A, B]


def test_requests_go_to_the_engine_with_fewest_outstanding():
    served = []

    async def go():
        gate = asyncio.Event()

        async def handler(request):
            served.append(base(request))
            if base(request) == A:  # A holds its request until released; B answers at once
                await gate.wait()
            return httpx.Response(200, json=sglang_response())

        async with client_with(handler) as client:
            slow = asyncio.create_task(client.generate(PROMPT, {}))
            while client.outstanding[A] < 1:
                await asyncio.sleep(0)
            # plain rotation would send every other one of these to A
            quick = [(await client.generate(PROMPT, {}))[ENGINE_URL_KEY] for _ in range(3)]
            during = client.outstanding
            gate.set()
            return during, quick, (await slow)[ENGINE_URL_KEY], client.outstanding

    during, quick, slow_url, after = run(go())
    assert during == {A: 1, B: 0} and quick == [B, B, B] and slow_url == A
    assert after == {A: 0, B: 0} and served == [A, B, B, B]


def test_api_key_is_sent_as_bearer_token():
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"model_path": "m", "weight_version": "0"})

    async def go():
        async with client_with(handler, urls=[A], api_key="sekret") as client:
            return await client.model_info()

    assert run(go()) == {A: {"model_path": "m", "weight_version": "0"}}
    assert seen == ["Bearer sekret"]


def test_control_calls_broadcast_and_report_failures_by_url():
    bodies = {}

    def handler(request):
        bodies.setdefault(request.url.path, []).append((base(request), json.loads(request.content)))
        if request.url.path == "/update_weights_from_distributed" and base(request) == B:
            return httpx.Response(400, json={"success": False, "message": "shape mismatch"})
        if request.url.path == "/pause_generation":
            return httpx.Response(
                200, json={"message": "Generation paused successfully.", "status": "ok"}
            )
        return httpx.Response(200, json={"success": True, "message": "ok"})

    async def go():
        async with client_with(handler) as client:
            paused = await client.pause_generation("retract")
            await client.update_weight_version(5)
            await client.init_weights_update_group("10.0.0.1", 29500, [1, 3], 5, backend="gloo")
            with pytest.raises(EngineError, match="shape mismatch") as err:
                await client.update_weights_from_distributed(
                    ["w"], ["torch.bfloat16"], [[2, 2]], weight_version=5
                )
            return paused, err.value

    paused, err = run(go())
    assert set(paused) == {A, B} and paused[A]["status"] == "ok"
    assert err.urls == [B] and err.status_code == 400
    assert {b["new_version"] for _, b in bodies["/update_weight_version"]} == {"5"}
    assert all(b["abort_all_requests"] is False for _, b in bodies["/update_weight_version"])
    offsets = {u: b["rank_offset"] for u, b in bodies["/init_weights_update_group"]}
    assert offsets == {A: 1, B: 3}
    update = bodies["/update_weights_from_distributed"][0][1]
    assert update["dtypes"] == ["bfloat16"] and update["weight_version"] == "5"


def test_single_rank_offset_for_several_engines_is_refused():
    async def go():
        async with client_with(lambda r: httpx.Response(200, json={})) as client:
            await client.init_weights_update_group("h", 1, 1, 3)

    with pytest.raises(ValueError, match="one per engine"):
        run(go())


def test_weight_broadcast_is_not_resent_after_a_read_timeout():
    calls = []

    def handler(request):
        calls.append(request.url.path)
        raise httpx.ReadTimeout("timed out", request=request)

    async def go():
        async with client_with(handler, urls=[A]) as client:
            await client.update_weights_from_distributed(["w"], ["float32"], [[1]])

    with pytest.raises(EngineError, match="not re-sent"):
        run(go())
    assert calls == ["/update_weights_from_distributed"]


def test_plain_and_empty_bodies_and_rid_routing():
    aborts = []

    def handler(request):
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if request.url.path == "/abort_request":
            aborts.append((base(request), json.loads(request.content)))
            return httpx.Response(200)
        if request.url.path == "/health":
            return httpx.Response(200 if base(request) == A else 503)
        return httpx.Response(200, json=sglang_response())

    async def go():
        async with client_with(handler, max_retries=1) as client:
            flushed = await client.flush_cache()
            aborted = await client.abort_request(abort_all=True)
            with pytest.raises(EngineError, match="HTTP 503") as err:
                await client.health()
            return flushed, aborted, err.value

    flushed, aborted, err = run(go())
    assert flushed == {A: {"message": "Cache flushed."}, B: {"message": "Cache flushed."}}
    assert aborted == {A: {}, B: {}}
    assert err.urls == [B]
    assert {u for u, _ in aborts} == {A, B} and aborts[0][1] == {"rid": "", "abort_all": True}


def test_lora_tensors_travel_as_base64_safetensors():
    torch = pytest.importorskip("torch")
    from safetensors.torch import load

    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"success": True, "error_message": None})

    name = "model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
    tensors = {name: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}

    async def go():
        async with client_with(handler, urls=[A]) as client:
            await client.load_lora_adapter_from_tensors("ad", tensors, {"r": 2, "lora_alpha": 4})

    run(go())
    payload = sent[0]
    assert set(payload) == {"lora_name", "config_dict", "safetensors_b64", "pinned"}
    assert payload["config_dict"] == {"r": 2, "lora_alpha": 4}
    back = load(base64.b64decode(payload["safetensors_b64"]))
    assert torch.equal(back[name], tensors[name]) and back[name].dtype == torch.bfloat16


def test_lora_refusal_uses_sglangs_error_message_field():
    def handler(request):
        return httpx.Response(400, json={"success": False, "error_message": "LoRA is not enabled"})

    async def go():
        async with client_with(handler, urls=[A]) as client:
            await client.load_lora_adapter("ad", "/shared/ad")

    with pytest.raises(EngineError, match="LoRA is not enabled"):
        run(go())


def test_wait_until_healthy_polls_until_every_engine_answers():
    answers = {A: [503, 200], B: [200]}

    def handler(request):
        codes = answers[base(request)]
        return httpx.Response(codes.pop(0) if len(codes) > 1 else codes[0])

    async def go():
        async with client_with(handler) as client:
            await client.wait_until_healthy(timeout_s=5, poll_s=0)
            with pytest.raises(EngineError, match="not healthy after 0s") as err:
                answers[B] = [503]
                await client.wait_until_healthy(timeout_s=0, poll_s=0)
            return err.value

    assert run(go()).urls == [B]


def test_generate_group_sends_one_request_per_sample_when_asked():
    rids = []

    def handler(request):
        rids.append(json.loads(request.content)["rid"])
        return httpx.Response(200, json=sglang_response())

    async def go():
        async with client_with(handler) as client:
            return await client.generate_group(
                PROMPT, {"temperature": 1.0}, 3, group_id=9, rid="p", one_request=False
            )

    trajs = run(go())
    assert [t.index for t in trajs] == [0, 1, 2] and {t.group_id for t in trajs} == {9}
    assert sorted(rids) == ["p-0", "p-1", "p-2"]


def test_generate_group_is_one_request_with_n_by_default():
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        n = body["sampling_params"]["n"]
        answers = [sglang_response(id=f"{body['rid']}_{i}") for i in range(n)]
        answers[1]["output_ids"] = [30, 22, 2]  # the samples differ: each decoded from its own
        answers[1]["meta_info"]["output_token_logprobs"][0] = [-0.5, 30, None]
        return httpx.Response(200, json=answers[: n - 1] if n == 4 else answers)

    async def go(n):
        async with client_with(handler) as client:
            return await client.generate_group(
                PROMPT, {"temperature": 1.0}, n, group_id=9, rid="p", routed_experts=True,
                sampling_mask=True, num_layers=2, topk=2,
            )  # fmt: skip

    trajs = run(go(3))
    assert len(bodies) == 1 and bodies[0]["sampling_params"] == {"temperature": 1.0, "n": 3}
    assert bodies[0]["rid"] == "p" and bodies[0]["return_routed_experts"] is True
    assert [t.index for t in trajs] == [0, 1, 2] and {t.group_id for t in trajs} == {9}
    assert [t.response_ids.tolist() for t in trajs] == [[21, 22, 2], [30, 22, 2], [21, 22, 2]]
    assert all(t.routed_experts is not None and t.mask_ids is not None for t in trajs)
    with pytest.raises(EngineError, match="n=4 with 3 answers"):
        run(go(4))


def test_an_openai_choice_without_sglangs_fields_names_them():
    from moerl.rollout.decode import response_from_openai_choice

    with pytest.raises(EngineError, match="return_meta_info=true and return_token_ids=true"):
        response_from_openai_choice({"message": {"content": "hi"}})
    choice = {
        "message": {"content": "hi"},
        "meta_info": {"weight_version": "3"},
        "response_token_ids": [7, 8],
        "prompt_token_ids": [5],
    }
    response, prompt = response_from_openai_choice(choice)
    assert response == {"text": "hi", "output_ids": [7, 8], "meta_info": {"weight_version": "3"}}
    assert prompt == [5]


def test_weight_update_sessions_open_on_every_engine_and_older_servers_need_none():
    """A 404 (an SGLang before weight-update sessions) counts as opened; a refusal raises."""
    calls = []

    def handler(request):
        calls.append((base(request), request.url.path, json.loads(request.content)))
        if base(request) == B:
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.url.path == "/end_weight_update" and len(calls) > 4:
            return httpx.Response(400, json={"success": False, "message": "no session is open"})
        return httpx.Response(200, json={"success": True, "message": "Success"})

    async def go():
        async with client_with(handler) as client:
            opened = await client.begin_weight_update()
            closed = await client.end_weight_update()
            with pytest.raises(
                EngineError, match="end_weight_update -> HTTP 400: no session is open"
            ):
                await client.end_weight_update()
            return opened, closed

    opened, closed = run(go())
    assert opened[A]["success"] and "has no /begin_weight_update" in opened[B]["message"]
    assert closed[A]["success"] and closed[B]["success"]
    assert calls[:2] == [(A, "/begin_weight_update", {"selector": "all"}),
                         (B, "/begin_weight_update", {"selector": "all"})]  # fmt: skip


def test_freeze_gc_reaches_every_engine_and_a_server_without_it_is_left_alone():
    """SGLang's /freeze_gc on each engine (a fake server: SGLang cannot run here); a
    server without the route (404) is left as it is, any other failure raises."""
    calls = []

    def handler(request):
        calls.append((base(request), request.method, request.url.path))
        if base(request) == B:
            return httpx.Response(404, json={"detail": "Not Found"})
        if len(calls) > 2:
            return httpx.Response(500, json={"error": "collector broke"})
        return httpx.Response(200, text="Garbage collection frozen.\n")

    async def go():
        async with client_with(handler) as client:
            frozen = await client.freeze_gc()
            with pytest.raises(EngineError, match="freeze_gc -> HTTP 500"):
                await client.freeze_gc(urls=[A])
            return frozen

    frozen = run(go())
    assert sorted(calls[:2]) == [(A, "POST", "/freeze_gc"), (B, "POST", "/freeze_gc")]
    assert set(frozen) == {A, B} and "has no /freeze_gc" in frozen[B]["message"]
