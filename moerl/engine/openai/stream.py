"""OpenAI streaming as SGLang 0.5.23 sends it (``_generate_completion_stream``,
``_generate_chat_stream``): server-sent ``data: {chunk}`` events built from the engine's
/generate responses so far, then ``data: [DONE]``."""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any

from moerl.engine.openai.requests import Call
from moerl.engine.openai.responses import (
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    finish,
    sglext,
    usage,
    usage_of,
)
from moerl.engine.openai.tool_calls import safe_prefix


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _visible(call: Call, text: str, final: bool) -> str:
    """Text safe to stream before the end: not a partial multi-byte character (U+FFFD at
    the end), nor a tail that may begin a stop string (the end trims a matched one), as
    SGLang's output streamer holds them back."""
    if final:
        return text
    text = text.rstrip("\ufffd")
    stops = call.body.get("stop") or []
    cut = len(text)
    for stop in [stops] if isinstance(stops, str) else stops:
        for k in range(min(len(stop), len(text)), 0, -1):
            if stop.startswith(text[-k:]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


class _Progress:
    """Per choice: characters, logprob rows and token ids already sent."""

    def __init__(self) -> None:
        self.chars: dict[int, int] = {}
        self.rows: dict[int, int] = {}
        self.ids: dict[int, int] = {}
        self.last: dict[int, dict[str, Any]] = {}

    def text(self, index: int, text: str) -> str:
        start = self.chars.get(index, 0)
        self.chars[index] = max(start, len(text))
        return text[start:]

    def new_rows(self, index: int, rows: list[Any]) -> tuple[int, int]:
        start = self.rows.get(index, 0)
        self.rows[index] = len(rows)
        return start, len(rows)

    def new_ids(self, index: int, ids: list[int]) -> list[int]:
        start = self.ids.get(index, 0)
        self.ids[index] = len(ids)
        return ids[start:]


def _aborted(meta: dict[str, Any]) -> str | None:
    """An SGLang streaming error chunk for an abort that carries an HTTP status."""
    reason = meta.get("finish_reason") or {}
    if reason.get("type") != "abort" or not reason.get("status_code"):
        return None
    status = int(reason["status_code"])
    body = {
        "object": "error",
        "message": str(reason.get("message")),
        "type": str(status),
        "param": None,
        "code": status,
    }
    return f"data: {json.dumps({'error': body})}\n\n"


def _tail(call: Call, kind: str, progress: _Progress, reqs: list[Any]) -> list[str]:
    """The chunks after the choices: sglext (choices []), then usage when asked."""
    rets = [progress.last[i] for i in sorted(progress.last)]
    if not rets:
        return []
    head = {
        "id": rets[0]["meta_info"]["id"],
        "object": kind,
        "created": int(time.time()),
        "model": call.model,
        "choices": [],
    }
    out = []
    ext = sglext(call, rets, reqs[0].input_ids if reqs else [])
    if ext:
        out.append(_sse({**head, "usage": None, "sglext": ext}))
    if call.include_usage:
        out.append(_sse({**head, "usage": usage_of(call, rets)}))
    return out


async def completion_events(call: Call, reqs: list[Any], items: Any) -> Any:
    """SGLang's ``_generate_completion_stream``: one chunk per engine update."""
    created, progress = int(time.time()), _Progress()
    async with aclosing(items):
        async for index, ret in items:
            meta = ret["meta_info"]
            error = _aborted(meta)
            if error:
                yield error
                break
            reason, matched = finish(meta)
            first = index not in progress.chars
            delta = progress.text(index, _visible(call, ret["text"], reason is not None))
            if first and call.echo:
                delta = call.echo[index // call.n] + delta
            choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None}
            if call.body.get("logprobs") is not None:
                rows = meta.get("output_token_logprobs", [])
                a, b = progress.new_rows(index, rows)
                echo_lp = first and bool(call.echo) and bool(call.body.get("logprobs"))
                choice["logprobs"] = completion_logprobs(
                    rows[a:b],
                    (meta.get("output_top_logprobs") or [])[a:b],
                    meta.get("input_token_logprobs") if echo_lp else None,
                    meta.get("input_top_logprobs") if echo_lp else None,
                )
            choice["finish_reason"], choice["matched_stop"] = reason, matched
            if call.flag("return_token_ids"):
                choice["token_ids"] = progress.new_ids(index, list(ret["output_ids"]))
                if first:
                    choice["prompt_token_ids"] = list(reqs[index].input_ids)
            chunk = {
                "id": meta["id"],
                "object": "text_completion",
                "created": created,
                "model": call.model,
                "choices": [choice],
                "usage": None,
            }
            if call.continuous_usage:
                chunk["usage"] = usage([meta["prompt_tokens"]], [meta["completion_tokens"]])
            progress.last[index] = ret
            yield _sse(chunk)
        else:
            for line in _tail(call, "text_completion", progress, reqs):
                yield line
    yield "data: [DONE]\n\n"


def _chat_chunk(
    meta: dict[str, Any], call: Call, created: int, index: int, delta: dict, **choice: Any
) -> str:
    """One choice's chunk; with ``stream_options.continuous_usage_stats`` its usage so far."""
    delta = {"reasoning_content": None, **delta}
    chunk: dict[str, Any] = {
        "id": meta["id"],
        "object": "chat.completion.chunk",
        "created": created,
        "model": call.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice.get("finish_reason"),
                "matched_stop": choice.get("matched_stop"),
            }
        ],
    }
    if call.continuous_usage:
        chunk["usage"] = usage([meta["prompt_tokens"]], [meta["completion_tokens"]])
    return _sse(chunk)


async def chat_events(call: Call, reqs: list[Any], items: Any) -> Any:
    """SGLang's ``_generate_chat_stream``: a role chunk, content deltas (held back where a
    ``<tool_call>`` may begin when the request has tools, all of it when tool_choice
    forces a call), tool calls once a choice finishes, then each choice's finish_reason."""
    created, progress = int(time.time()), _Progress()
    finished: dict[int, tuple[dict[str, Any], str, Any]] = {}
    async with aclosing(items):
        async for index, ret in items:
            meta = ret["meta_info"]
            error = _aborted(meta)
            if error:
                yield error
                break
            if index not in progress.chars:
                yield _chat_chunk(meta, call, created, index, {"role": "assistant", "content": ""})
            reason, matched = finish(meta)
            text = _visible(call, ret["text"] or "", reason is not None)
            calls: list[dict[str, Any]] = []
            if call.tools and reason is None:  # a forced call's array is all calls
                text = text[: 0 if call.forced_calls else safe_prefix(text)]
            elif call.tools:
                message, reason, matched = assistant_message(call, text, reason, matched)
                text, calls = message["content"], message.get("tool_calls", [])
            logprobs = None
            if call.flag("logprobs"):
                rows = meta["output_token_logprobs"]
                a, b = progress.new_rows(index, rows)
                if b > a:
                    tops = meta.get("output_top_logprobs")
                    logprobs = chat_logprobs(rows[a:b], tops[a:b] if tops else None, call.tokenizer)
            delta = progress.text(index, text)
            if delta or logprobs:
                yield _chat_chunk(meta, call, created, index, {"content": delta}, logprobs=logprobs)
            if calls:
                yield _chat_chunk(meta, call, created, index, {"tool_calls": calls})
            progress.last[index] = ret
            if reason is not None:
                finished[index] = (meta, reason, matched)
        else:
            for index, (meta, reason, matched) in sorted(finished.items()):
                yield _chat_chunk(
                    meta, call, created, index, {}, finish_reason=reason, matched_stop=matched
                )
            for line in _tail(call, "chat.completion.chunk", progress, reqs):
                yield line
    yield "data: [DONE]\n\n"
