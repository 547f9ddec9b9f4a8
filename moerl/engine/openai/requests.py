"""OpenAI request bodies → the engine's /generate body, as SGLang 0.5.23's
``serving_completions.py`` / ``serving_chat.py`` convert them to ``GenerateReqInput``.

Field names, types and defaults are SGLang's ``CompletionRequest`` and
``ChatCompletionRequest`` (``sglang/srt/entrypoints/openai/protocol.py``). The result goes
through /generate's own checks (``check_generate``, ``parse_generate``), so a bad sampling
value is refused exactly as there. A field SGLang knows but the embedded engine does not
serve is a 400 naming it when set to anything but its default; a key SGLang does not know
is ignored, as SGLang's pydantic models ignore it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moerl.engine.openai.chat_template import apply_template, chat_messages
from moerl.engine.openai.tool_choice import (
    ToolChoice,
    calls_schema,
    check_unconstrained,
    tool_choice,
)
from moerl.engine.validate import (
    BOOL,
    INT,
    INTS,
    NUMBER,
    OBJECT,
    STR,
    STR_TO_NUMBER,
    STRS,
    Kind,
    RequestError,
    check_fields,
    check_finite,
    list_of,
    show,
)

LISTS = list_of(list_of(INT, "token ids"), "a list of lists of token ids")
OBJECTS = list_of(OBJECT, "a list of objects")

# Fields both routes share, with SGLang's types.
COMMON: dict[str, Kind] = {
    "model": STR,
    "frequency_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "logit_bias": STR_TO_NUMBER,
    "n": INT,
    "seed": INT,
    "stop": STR | STRS,
    "stream": BOOL,
    "stream_options": OBJECT,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "user": STR,
    "return_routed_experts": BOOL,
    "routed_experts_start_len": INT,
    "return_token_ids": BOOL,
    "top_k": INT,
    "min_p": NUMBER,
    "min_tokens": INT,
    "regex": STR,
    "ebnf": STR,
    "repetition_penalty": NUMBER,
    "stop_token_ids": INTS,
    "stop_regex": STR | STRS,
    "no_stop_trim": BOOL,
    "ignore_eos": BOOL,
    "skip_special_tokens": BOOL,
    "lora_path": STR,
    "response_format": OBJECT,
    "custom_params": OBJECT,
    "watermark": OBJECT,
    "rid": STR,
}
COMPLETION: dict[str, Kind] = {
    **COMMON,
    "prompt": STR | STRS | INTS | LISTS,
    "echo": BOOL,
    "logprobs": INT,
    "max_tokens": INT,
    "json_schema": STR,
}
CHAT: dict[str, Kind] = {
    **COMMON,
    "messages": OBJECTS,
    "logprobs": BOOL,
    "top_logprobs": INT,
    "max_tokens": INT,
    "max_completion_tokens": INT,
    "tools": OBJECTS,
    "tool_choice": STR | OBJECT,
    "parallel_tool_calls": BOOL,
    "return_prompt_token_ids": BOOL,
    "return_meta_info": BOOL,
    "return_input_ids_in_sglext": BOOL,
    "return_output_ids_in_sglext": BOOL,
    "return_sampling_mask": BOOL,
    "sampling_logprobs_mode": STR,
    "continue_final_message": BOOL,
    "separate_reasoning": BOOL,
    "stream_reasoning": BOOL,
    "chat_template_kwargs": OBJECT,
    "input_ids": INTS,
    "reasoning_effort": STR | NUMBER,
}

# SGLang fields the embedded engine does not serve, with their defaults: anything else
# is refused (400) rather than ignored.
REFUSED: dict[str, Any] = {
    "best_of": None,
    "suffix": None,
    "return_hidden_states": False,
    "return_cached_tokens_details": False,
    "return_spec_tokens_details": False,
    "return_flat_raw_output_top_logprobs": False,
    "session_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "images_config": None,
    "video_config": None,
    "mm_processor_kwargs": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "use_audio_in_video": False,
    "thinking": None,
    "task": None,
    "priority": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
}
# Accepted and without effect here, as in SGLang without the matching server feature:
# ``user``, ``extra_key``, ``cache_salt``, ``custom_labels`` (no prefix cache or
# metrics labels), ``separate_reasoning`` / ``stream_reasoning`` (no reasoning parser).

# SGLang's sampling defaults for chat when neither the request nor the checkpoint's
# generation_config.json sets them (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS).
CHAT_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass
class Call:
    """One OpenAI request, translated: the /generate body and what the reply needs."""

    generate: dict[str, Any]
    model: str
    n: int
    stream: bool
    body: dict[str, Any]  # the request as sent (flags the reply reads)
    echo: list[str] = field(default_factory=list)  # completions: text put before each
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat: tools to parse
    forced_calls: bool = False  # chat: the output is a JSON array of calls (tool_choice.py)
    tokenizer: Any = None  # chat: the token bytes of logprobs

    def flag(self, name: str) -> bool:
        return bool(self.body.get(name))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("continuous_usage_stats"))


def _check(body: dict[str, Any], kinds: dict[str, Kind]) -> None:
    check_fields(body, kinds)  # types first: a bool given -Infinity is named as not a bool
    check_finite(body)
    for name, default in REFUSED.items():
        value = body.get(name)
        if value is not None and value != default:
            raise RequestError(
                name, f"is not served by the embedded engine (got {show(value)}); use SGLang"
            )
    n = body.get("n")
    if n is not None and n < 1:
        raise RequestError("n", f"must be >= 1, got {n}")
    start = body.get("routed_experts_start_len")
    if start is not None and start < 0:
        raise RequestError("routed_experts_start_len", f"must be >= 0, got {start}")


def _sampling(body: dict[str, Any], defaults: dict[str, Any], max_new: int | None) -> dict:
    """SGLang's ``to_sampling_params`` / ``_build_sampling_params`` mapping."""

    def pick(name: str) -> Any:
        value = body.get(name)
        return defaults.get(name) if value is None else value

    params = {
        "max_new_tokens": max_new,
        "min_new_tokens": body.get("min_tokens") or 0,
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "stop_regex": body.get("stop_regex"),
        "temperature": pick("temperature"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "min_p": pick("min_p"),
        "repetition_penalty": pick("repetition_penalty"),
        "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"),
        "regex": body.get("regex"),
        "ebnf": body.get("ebnf"),
        "json_schema": body.get("json_schema"),
        "n": body.get("n") or 1,
        "no_stop_trim": body.get("no_stop_trim"),
        "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "logit_bias": body.get("logit_bias"),
        "custom_params": body.get("custom_params"),
        "sampling_seed": body.get("seed"),
        "watermark": body.get("watermark"),
    }
    fmt = body.get("response_format")
    if fmt:
        kind = fmt.get("type")
        if kind == "json_object":
            params["json_schema"] = '{"type": "object"}'
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if schema is None:
                raise RequestError(
                    "response_format", "schema_ is required for json_schema response format"
                )
            params["json_schema"] = json.dumps(schema)
        elif kind == "structural_tag":
            raise RequestError("response_format", "structural_tag is not served; use json_schema")
        elif kind != "text":
            raise RequestError("response_format.type", f"unknown type {show(kind)}")
    return {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}


def _lora(body: dict[str, Any]) -> str | None:
    """SGLang's ``model="base:adapter"`` form wins over ``lora_path``."""
    model = body.get("model") or ""
    if ":" in model:
        adapter = model.split(":", 1)[1].strip()
        if adapter:
            return adapter
    return body.get("lora_path")


def _generate_body(body: dict[str, Any], prompt: dict[str, Any], sampling: dict) -> dict:
    out: dict[str, Any] = {
        **prompt,
        "sampling_params": sampling,
        "return_text_in_logprobs": True,
        "return_routed_experts": bool(body.get("return_routed_experts")),
        "routed_experts_start_len": body.get("routed_experts_start_len") or 0,
        "stream": False,  # the OpenAI layer streams; /generate's machinery runs it
    }
    for name in ("rid", "return_sampling_mask", "sampling_logprobs_mode"):
        if body.get(name) is not None:
            out[name] = body[name]
    lora = _lora(body)
    if lora:
        out["lora_path"] = lora
    return out


def completion_call(body: dict[str, Any], tokenizer: Any) -> Call:
    """/v1/completions (``OpenAIServingCompletion._convert_to_internal_request``)."""
    _check(body, COMPLETION)
    prompt = body.get("prompt")
    if not prompt or (
        isinstance(prompt, list) and not isinstance(prompt[0], int) and not all(prompt)
    ):
        raise RequestError("prompt", "Prompt cannot be empty")
    max_tokens = body.get("max_tokens")
    max_tokens = 16 if max_tokens is None else max_tokens  # SGLang's default
    if max_tokens <= 0:
        raise RequestError("max_tokens", f"max_tokens must be positive, got {max_tokens}")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs < 0:
        raise RequestError("logprobs", f"must be >= 0, got {logprobs}")
    texts = isinstance(prompt, str) or isinstance(prompt[0], str)
    gen = _generate_body(
        body,
        {"text": prompt} if texts else {"input_ids": prompt},
        _sampling(body, {}, max_tokens),
    )
    echo = bool(body.get("echo"))
    gen["return_logprob"] = logprobs is not None
    gen["top_logprobs_num"] = logprobs or 0
    gen["logprob_start_len"] = 0 if echo and logprobs else -1
    call = Call(
        gen,
        body.get("model") or "default",
        gen["sampling_params"]["n"],
        bool(body.get("stream")),
        body,
    )
    if echo:
        prompts = (
            prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
        )
        call.echo = [p if isinstance(p, str) else _decode(tokenizer, p) for p in prompts]
    return call


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=True))


def _tools(body: dict[str, Any], parser: str | None) -> tuple[list[dict[str, Any]], ToolChoice]:
    """The request's tools, checked, and its tool_choice; no tools when the choice is
    "none" (as SGLang, the template then gets no tools and nothing is parsed) and only
    the named one for a named choice (the template shows the model that one)."""
    tools = body.get("tools") or []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}]", 'must be {"type": "function", "function": {...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}].function.name", "must be a non-empty string")
    choice = tool_choice(body)
    if choice.mode == "none" or not tools:
        return [], choice
    if parser is None:
        raise RequestError(
            "tools",
            "the engine was started without --tool-call-parser, so tool calls would come "
            "back unparsed; start it with --tool-call-parser qwen25 (the "
            '<tool_call>{json}</tool_call> format) or send tool_choice="none"',
        )
    if choice.forced:
        check_unconstrained(body)
    return [t for t in tools if choice.name in (None, t["function"]["name"])], choice


def chat_call(
    body: dict[str, Any],
    tokenizer: Any,
    tool_parser: str | None,
    defaults: dict[str, Any],
    context_len: int,
) -> Call:
    """/v1/chat/completions (``OpenAIServingChat._convert_to_internal_request``):
    ``defaults`` are the checkpoint's generation_config sampling values."""
    _check(body, CHAT)
    messages = chat_messages(body.get("messages") or [])
    ctk = dict(body.get("chat_template_kwargs") or {})
    if "chat_template" in ctk:
        raise RequestError(
            "chat_template_kwargs.chat_template",
            "Request-supplied chat_template is not allowed by the embedded engine",
        )
    if body.get("return_sampling_mask") and not body.get("return_meta_info"):
        raise RequestError(
            "return_sampling_mask", "return_sampling_mask requires return_meta_info=true."
        )
    if body.get("stream"):
        for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
            if body.get(name):
                raise RequestError(
                    name, f"{name} is not supported with streaming; set stream=false"
                )
    effort = body.get("reasoning_effort")
    if effort is not None:  # SGLang's normalize_reasoning_inputs
        ctk.setdefault("thinking", effort != "none")
        ctk.setdefault("enable_thinking", effort != "none")
    tools, choice = _tools(body, tool_parser)
    for name in ("max_tokens", "max_completion_tokens", "top_logprobs"):
        value = body.get(name)
        if value is not None and value < (0 if name == "top_logprobs" else 1):
            raise RequestError(
                name, f"must be >= {0 if name == 'top_logprobs' else 1}, got {value}"
            )
    ids = body.get("input_ids")
    if ids is None:
        ids = apply_template(tokenizer, messages, tools, body, ctk)
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_new is not None and max_new > context_len:  # SGLang's _validate_request
        name = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        raise RequestError(
            name, f"is too large: {max_new}; this model supports at most {context_len} tokens"
        )
    sampling = _sampling(body, {**CHAT_DEFAULTS, **defaults}, max_new)
    if choice.forced:
        schema = calls_schema(tools, choice, body.get("parallel_tool_calls") is not False)
        sampling["json_schema"] = json.dumps(schema)
    gen = _generate_body(body, {"input_ids": ids}, sampling)
    gen["return_logprob"] = bool(body.get("logprobs"))
    gen["top_logprobs_num"] = body.get("top_logprobs") or 0
    gen["logprob_start_len"] = -1
    return Call(
        gen,
        body.get("model") or "default",
        gen["sampling_params"]["n"],
        bool(body.get("stream")),
        body,
        tools=tools,
        forced_calls=choice.forced,
        tokenizer=tokenizer,
    )
