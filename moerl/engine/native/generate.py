"""SGLang's native ``/generate``: a body parsed into scheduler requests, their answers
built as SGLang's (``meta_info``, logprobs, routed experts, weight-version spans), and
streamed as its server-sent events. Used by the native route (moerl/engine/app.py) and the
OpenAI-compatible layer (moerl/engine/openai/api.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
import orjson
from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from moerl.engine.core.sampling import SamplingParams
from moerl.engine.core.scheduler import LoopCallback, Request, new_rid
from moerl.engine.core.state import EngineState
from moerl.engine.validate import (
    split_batch,
)

log = logging.getLogger(__name__)


class GenerateResponse(Response):
    """/generate's answer rendered as SGLang renders it: orjson, numpy values as they
    are, non-string keys allowed, NaN and infinities as null (5-10x faster than the
    json module on a group's logprobs and routes)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def resolve_on(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Request]) -> LoopCallback:
    """A ``Request.on_done`` (called on the scheduler thread) that resolves ``future`` on
    ``loop`` with the finished request, unless it is done already (cancelled)."""

    def resolve(r: Request) -> None:
        if not future.done():
            future.set_result(r)

    return LoopCallback(loop, resolve)


async def _until_disconnect(request: HTTPRequest) -> None:
    """Returns when the client has gone (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """Output-token spans [start, end) of constant weight version (SGLang's
    ``weight_versions``; a response without tokens gets one empty span)."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def _token_texts(state: EngineState, ids: list[int], on: bool) -> list[str | None]:
    """Each token's own text (SGLang's return_text_in_logprobs), or None per token."""
    if not on or state.tokenizer is None:
        return [None] * len(ids)
    return list(state.tokenizer.batch_decode([[i] for i in ids]))


def _logprob_rows(
    state: EngineState,
    values: list[Any],
    ids: list[int],
    on: bool,
) -> list[list[Any]]:
    return [[v, i, t] for v, i, t in zip(values, ids, _token_texts(state, ids, on))]


def _top_rows(state: EngineState, rows: list[Any], on: bool) -> list[Any]:
    """Per position: None, or [[logprob, id, text], ...] (top or requested ids)."""
    return [
        None if row is None else _logprob_rows(state, [v for v, _ in row], [i for _, i in row], on)
        for row in rows
    ]


def output_text(state: EngineState, req: Request) -> str:
    """The output as text, as SGLang's detokenizer returns it: special tokens skipped by
    default, and a matched stop token or stop string cut off unless ``no_stop_trim``."""
    if state.tokenizer is None:
        return ""
    params, ids = req.params, req.output_ids
    matched = (req.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]
    text = str(
        state.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
    )
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
    return text


def build_response(state: EngineState, req: Request) -> dict[str, Any]:
    """A finished (or in-progress, for streaming) request as SGLang's response JSON."""
    spans = _spans(req.versions, state.scheduler.weight_version)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "weight_version": spans[-1]["version"],
    }
    if req.done:  # as SGLang: the spans come with the finished response
        meta["weight_versions"] = spans
    if req.return_logprob:
        texts = req.return_text_in_logprobs
        prompt = req.input_ids[req.logprob_start_len :]
        meta["input_token_logprobs"] = _logprob_rows(state, req.input_logprobs, prompt, texts)
        meta["output_token_logprobs"] = _logprob_rows(state, req.logprobs, req.output_ids, texts)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_rows(state, req.input_top_logprobs, texts)
            meta["output_top_logprobs"] = _top_rows(state, req.top_logprobs, texts)
        if req.token_ids_logprob:
            chosen = req.token_ids_logprob
            meta["input_token_ids_logprobs"] = _top_rows(
                state,
                [None if r is None else list(zip(r, chosen)) for r in req.input_ids_logprobs],
                texts,
            )
            meta["output_token_ids_logprobs"] = _top_rows(
                state, [list(zip(r, chosen)) for r in req.ids_logprobs], texts
            )
    if req.return_routed_experts:
        rows = np.concatenate(req.routes, axis=0) if req.routes else np.zeros((0, 0, 0), np.int32)
        end = len(req.input_ids) + len(req.output_ids) - 1
        rows = np.ascontiguousarray(
            rows[req.routed_experts_start_len : max(end, 0)], dtype=np.int32
        )
        meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
    if req.return_sampling_mask:
        meta["output_token_sampling_mask"] = req.masks
        meta["output_token_sampling_logprobs"] = req.sampling_logprobs
        meta["output_token_sampling_mask_length"] = len(req.masks)
    return {"text": output_text(state, req), "output_ids": list(req.output_ids), "meta_info": meta}


def parse_generate(state: EngineState, body: dict[str, Any]) -> list[Request]:
    """Every sequence a checked /generate body asks for: prompt after prompt of a batch,
    each prompt's ``n`` samples in a row (SGLang's order)."""
    if body.get("custom_logit_processor"):
        raise ValueError(
            "custom_logit_processor is not served by the embedded engine (it would run "
            "code sent over the network)"
        )
    return [req for item in split_batch(body) for req in _parse_one(state, item)]


def _parse_one(state: EngineState, body: dict[str, Any]) -> list[Request]:
    runner, sched = state.runner, state.scheduler
    # As SGLang: unknown top-level keys are ignored; unknown sampling_params are rejected.
    ids = body.get("input_ids")
    if ids is None and body.get("text") is not None:
        if state.tokenizer is None:
            raise ValueError("text input needs a tokenizer in the model directory; send input_ids")
        ids = state.tokenizer(body["text"]).input_ids
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("input_ids must be a non-empty list of token ids (or text a string)")
    bad = [t for t in ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise ValueError(f"input_ids contain ids outside [0, {runner.vocab_size}): {bad[:5]}")
    params = SamplingParams.from_request(body.get("sampling_params"), runner.vocab_size)
    if len(ids) >= runner.context_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context is {runner.context_len} "
            "(max_position_embeddings): shorten the prompt"
        )
    if state.tokenizer is None and (params.stop_strs or params.stop_regexes or params.grammar):
        raise ValueError("stop, stop_regex and grammars need a tokenizer in the model directory")
    return_logprob = bool(body.get("return_logprob", False))
    start = body.get("logprob_start_len")
    start = len(ids) - 1 if start in (None, -1) else start
    if return_logprob and not 0 <= start < len(ids):
        raise ValueError(
            f"logprob_start_len={start} must be -1 or in [0, {len(ids)}) (the prompt has "
            f"{len(ids)} tokens)"
        )
    top_n = int(body.get("top_logprobs_num") or 0)
    if top_n < 0:
        raise ValueError(f"top_logprobs_num={top_n} must be >= 0")
    chosen = body.get("token_ids_logprob") or None
    outside = [t for t in chosen or [] if not 0 <= t < runner.vocab_size]
    if outside:
        raise ValueError(
            f"token_ids_logprob: ids must be in [0, {runner.vocab_size}), got {outside[:5]}"
        )
    # As SGLang: without --enable-return-routed-experts the key is silently absent from
    # the response (the client turns that into a clear error).
    routed = bool(body.get("return_routed_experts", False)) and sched.enable_routed_experts
    routed_start = int(body.get("routed_experts_start_len") or 0)
    if not 0 <= routed_start <= len(ids):
        raise ValueError(f"routed_experts_start_len={routed_start} must be in [0, {len(ids)}]")
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and not body.get("return_sampling_mask"):
        raise ValueError("sampling_logprobs_mode needs return_sampling_mask=true")
    mode = mode or "selected"
    if mode not in ("selected", "support"):
        raise ValueError(f"sampling_logprobs_mode={mode!r}: choose 'selected' or 'support'")
    lora = body.get("lora_path")
    if lora:
        if runner.lora is None:
            raise ValueError(f"lora_path={lora!r}: the server was started without --enable-lora")
        if lora not in runner.lora.adapters:
            raise ValueError(f"lora_path={lora!r}: no LoRA adapter of that name is loaded")
    grammar = params.grammar
    if grammar is not None:
        state.grammar_backend().check(*grammar)
    rid = str(body.get("rid") or new_rid())
    n = params.n
    return [
        Request(
            rid=rid if n == 1 else f"{rid}_{i}",
            input_ids=list(ids),
            params=params,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_n,
            token_ids_logprob=chosen,
            return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
            return_routed_experts=routed,
            routed_experts_start_len=routed_start,
            return_sampling_mask=bool(body.get("return_sampling_mask", False)),
            sampling_logprobs_mode=mode,
            lora=lora or None,
            matcher=None if grammar is None else state.grammar_backend().matcher(*grammar),
        )
        for i in range(n)
    ]


def start_stream(
    state: EngineState, reqs: list[Request]
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Queue ``reqs`` (before any reply: a full queue is still a 503) and return their
    responses so far as ``(index, response)``: every ``stream_interval`` tokens and, once
    each finishes, its final response (``meta_info.finish_reason`` set). Closing the
    iterator early (the client went away) aborts the requests still running."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
    for index, req in enumerate(reqs):
        interval = req.params.stream_interval or state.stream_interval

        def on_token(r: Request, i: int = index, every: int = interval) -> None:
            if not r.done and len(r.output_ids) % every == 0:
                item = build_response(state, r)  # a snapshot, taken on the scheduler thread
                loop.call_soon_threadsafe(chunks.put_nowait, (i, item))

        def on_done(r: Request, i: int = index) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, (i, None))

        req.on_token, req.on_done = on_token, on_done
    state.scheduler.submit(*reqs)

    async def items() -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        try:
            open_ = len(reqs)
            while open_:
                index, item = await chunks.get()
                if item is None:  # finished: the final response, built once
                    open_ -= 1
                    item = build_response(state, reqs[index])
                yield index, item
        finally:  # the client went away (the stream was closed): stop its work
            left = [r for r in reqs if not r.done]
            if left:
                state.scheduler.cancel(left, "the client disconnected")

    return items()


# the per-output-token meta_info lists an incremental chunk cuts to its new tokens, as
# SGLang's tokenizer manager does (_INCREMENTAL_STREAMING_META_INFO_KEYS)
PER_TOKEN_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
)


class _Increments:
    """What one sequence's stream has sent (``--incremental-streaming-output``): each
    chunk keeps only the tokens and text after it. Text that ends in an incomplete
    character (U+FFFD) is held back until the character is whole, since its decoding can
    still change; a final text that no longer extends what was sent (a stop string
    trimmed from the end) adds nothing."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""

    def cut(self, item: dict[str, Any], final: bool) -> dict[str, Any]:
        meta = item["meta_info"]
        for key in PER_TOKEN_KEYS:
            if key in meta:
                meta[key] = meta[key][self.tokens :]
        ids = item["output_ids"]
        item["output_ids"], self.tokens = ids[self.tokens :], len(ids)
        text = item["text"] if final else item["text"].rstrip("\ufffd")
        if text.startswith(self.text):
            item["text"], self.text = text[len(self.text) :], text
        else:
            item["text"] = ""
        return item


def stream_response(state: EngineState, reqs: list[Request], indexed: bool) -> StreamingResponse:
    """Server-sent events as SGLang streams /generate: the response so far (with ``index``
    when the body was a batch or asked for n > 1), or with --incremental-streaming-output
    what is new since the last chunk, then ``[DONE]``."""
    items = start_stream(state, reqs)
    sent = [_Increments() for _ in reqs] if state.incremental_stream else None

    async def events() -> AsyncIterator[str]:
        async with aclosing(items):
            async for index, item in items:
                if sent is not None:
                    final = item["meta_info"]["finish_reason"] is not None
                    item = sent[index].cut(item, final)
                if indexed:
                    item["index"] = index
                yield f"data: {json.dumps(item)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _settled(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def run_all(
    state: EngineState, request: HTTPRequest, reqs: list[Request]
) -> list[Request] | None:
    """Queue ``reqs`` and await them all; None when the client went away first (its
    requests are then aborted)."""
    loop = asyncio.get_running_loop()
    futures = []
    for req in reqs:
        future: asyncio.Future[Request] = loop.create_future()
        req.on_done = resolve_on(loop, future)
        futures.append(future)
    state.scheduler.submit(*reqs)
    results: asyncio.Future[list[Request]] = asyncio.gather(*futures)
    gone: asyncio.Future[None] = asyncio.ensure_future(_until_disconnect(request))
    either: set[asyncio.Future[Any]] = {results, gone}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not results.done():  # client went away (or the server stops): stop its work
            # retrieved once it settles, so asyncio logs no "exception was never retrieved"
            # traceback for a client that simply left
            results.add_done_callback(_settled)
            results.cancel()
            state.scheduler.cancel(reqs, "the client disconnected")
    return results.result() if results.done() else None


def failure(reqs: list[Request]) -> tuple[str, int] | None:
    """(message, HTTP status) of the first request aborted with a status, as SGLang
    answers those with an error rather than a response."""
    for r in reqs:
        reason = r.finish_reason or {}
        if reason.get("status_code"):
            return str(reason.get("message")), int(reason["status_code"])
    return None
