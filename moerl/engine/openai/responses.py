"""OpenAI response bodies from the engine's /generate responses, as SGLang 0.5.23's
``serving_completions.py`` / ``serving_chat.py`` build ``CompletionResponse`` and
``ChatCompletionResponse`` (``protocol.py``) from its tokenizer manager's results: each
``ret`` is one finished choice's ``{"text", "output_ids", "meta_info"}``."""

from __future__ import annotations

import time
from typing import Any

from moerl.engine.openai.requests import Call
from moerl.engine.openai.token_bytes import token_bytes
from moerl.engine.openai.tool_calls import parse_call_array, parse_tool_calls

# -- pieces of a response ---------------------------------------------------------------


def usage(prompt: list[int], completion: list[int]) -> dict[str, Any]:
    """SGLang's UsageInfo; ``prompt`` has one count per prompt, ``completion`` per choice."""
    p, c = sum(prompt), sum(completion)
    return {
        "prompt_tokens": p,
        "total_tokens": p + c,
        "completion_tokens": c,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def usage_of(call: Call, rets: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = [rets[i]["meta_info"]["prompt_tokens"] for i in range(0, len(rets), call.n)]
    return usage(prompt, [r["meta_info"]["completion_tokens"] for r in rets])


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def completion_logprobs(
    rows: list[Any], tops: list[Any], input_rows: list[Any] | None = None, input_tops: Any = None
) -> dict[str, Any]:
    """SGLang's ``to_openai_style_logprobs``: rows are [logprob, id, text]."""
    rows = (input_rows or []) + rows
    top_rows = (input_tops or []) + (tops or [])
    return {
        "text_offset": [-1] * len(rows),
        "token_logprobs": [r[0] for r in rows],
        "tokens": [r[2] or "" for r in rows],
        "top_logprobs": [
            None if row is None else {t[2] or "": t[0] for t in row} for row in top_rows
        ],
    }


def chat_logprobs(rows: list[Any], tops: list[Any] | None, tokenizer: Any = None) -> dict:
    """SGLang's ChoiceLogprobs: ``bytes`` are the token's raw bytes (``token_bytes``)."""
    content = []
    for i, (logprob, token, text) in enumerate(rows):
        top = (tops[i] if tops and i < len(tops) else None) or []
        content.append(
            {
                "token": text or "",
                "bytes": token_bytes(tokenizer, token, text),
                "logprob": logprob,
                "top_logprobs": [
                    {"token": t or "", "bytes": token_bytes(tokenizer, tid, t), "logprob": lp}
                    for lp, tid, t in top
                ],
            }
        )
    return {"content": content}


def sglext(call: Call, rets: list[dict[str, Any]], prompt_ids: list[int]) -> dict | None:
    """Response-level ``sglext``: the first choice's routes (unless each choice has its own
    meta_info) and, for chat, the prompt and output ids when asked."""
    ext: dict[str, Any] = {}
    routes = rets[0]["meta_info"].get("routed_experts") if rets else None
    if call.flag("return_routed_experts") and not call.flag("return_meta_info") and routes:
        ext["routed_experts"] = routes
    if call.flag("return_input_ids_in_sglext"):
        ext["input_ids"] = list(prompt_ids)
    if call.flag("return_output_ids_in_sglext"):
        ext["output_ids"] = [list(r["output_ids"]) for r in rets]
    return ext or None


def _with_ext(response: dict[str, Any], ext: dict | None) -> dict[str, Any]:
    if ext:
        response["sglext"] = ext
    return response


# -- non-streaming ------------------------------------------------------------------------


def completion_response(call: Call, rets: list[dict], prompts: list[list[int]]) -> dict:
    choices = []
    for i, ret in enumerate(rets):
        meta = ret["meta_info"]
        text = ret["text"]
        if call.echo:
            text = call.echo[i // call.n] + text
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None}
        if call.body.get("logprobs") is not None:
            echo_lp = bool(call.echo) and bool(call.body.get("logprobs"))
            choice["logprobs"] = completion_logprobs(
                meta.get("output_token_logprobs", []),
                meta.get("output_top_logprobs", []),
                meta.get("input_token_logprobs") if echo_lp else None,
                meta.get("input_top_logprobs") if echo_lp else None,
            )
        choice["finish_reason"], choice["matched_stop"] = finish(meta)
        if call.flag("return_token_ids"):
            choice["token_ids"] = list(ret["output_ids"])
            choice["prompt_token_ids"] = list(prompts[i])
        choices.append(choice)
    return _envelope(call, "text_completion", choices, rets, prompts)


def assistant_message(
    call: Call, text: str, reason: str | None, matched: Any
) -> tuple[dict, str | None, Any]:
    """The assistant message, with tool calls parsed out when the request has tools."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
    if call.tools:
        parse = parse_call_array if call.forced_calls else parse_tool_calls
        parsed = parse(text, call.tools)
        if parsed.calls:
            calls = parsed.calls if call.body.get("parallel_tool_calls", True) else parsed.calls[:1]
            message["content"], message["tool_calls"] = parsed.content, calls
            if reason == "stop":
                reason, matched = "tool_calls", None
    return message, reason, matched


def chat_response(call: Call, rets: list[dict], prompts: list[list[int]]) -> dict:
    choices = []
    for i, ret in enumerate(rets):
        meta = ret["meta_info"]
        reason, matched = finish(meta)
        message, reason, matched = assistant_message(call, ret["text"] or "", reason, matched)
        choice: dict[str, Any] = {"index": i, "message": message, "logprobs": None}
        if call.flag("logprobs"):
            choice["logprobs"] = chat_logprobs(
                meta["output_token_logprobs"], meta.get("output_top_logprobs"), call.tokenizer
            )
        choice["finish_reason"], choice["matched_stop"] = reason, matched
        if call.flag("return_prompt_token_ids") or call.flag("return_token_ids"):
            choice["prompt_token_ids"] = list(prompts[i])
        if call.flag("return_token_ids"):
            choice["response_token_ids"] = list(ret["output_ids"])
        if call.flag("return_meta_info"):
            choice["meta_info"] = meta
        choices.append(choice)
    return _envelope(call, "chat.completion", choices, rets, prompts)


def _envelope(
    call: Call, obj: str, choices: list[dict], rets: list[dict], prompts: list[list[int]]
) -> dict:
    """A whole (non-streamed) response of ``obj`` around its ``choices``."""
    response = {
        "id": rets[0]["meta_info"]["id"],
        "object": obj,
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage_of(call, rets),
        "metadata": _metadata(rets[0]["meta_info"]),
    }
    return _with_ext(response, sglext(call, rets, prompts[0]))
