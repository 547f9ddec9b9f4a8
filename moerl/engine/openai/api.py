"""OpenAI-compatible routes as SGLang 0.5.23 serves them: ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (docs/architecture.md, "The
engine protocol").

A request is translated to a /generate body (``requests``), checked and run by
/generate's own machinery (``parse_generate``, ``run_all``, ``start_stream``), and its
/generate responses are rendered in SGLang's OpenAI shapes (``protocol.py``'s
``CompletionResponse``, ``ChatCompletionResponse`` and their stream chunks): ``usage``,
``metadata.weight_version(s)``, and SGLang's RL extension fields —

- ``return_routed_experts``: ``sglext.routed_experts`` (the first choice's base64 routes,
  as /generate's ``meta_info.routed_experts``); with chat's ``return_meta_info`` each
  choice carries its own ``meta_info`` (routes, logprobs, ``weight_versions``, and with
  ``return_sampling_mask`` the sampling mask) instead;
- ``return_token_ids``: completions' ``choices[].token_ids`` / ``prompt_token_ids``, chat's
  ``choices[].response_token_ids`` / ``prompt_token_ids`` (chat's
  ``return_prompt_token_ids`` alone gives the prompt ids);
- chat's ``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext``:
  ``sglext.input_ids`` and ``sglext.output_ids`` (one list per choice), streaming too.

Errors are SGLang's ``ErrorResponse``: ``{"object": "error", "message", "type", "param",
"code"}`` with status 400 for a bad request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moerl.engine.core.state import EngineState
from moerl.engine.native.generate import (
    build_response,
    failure,
    parse_generate,
    run_all,
    start_stream,
)
from moerl.engine.openai.requests import Call, chat_call, completion_call
from moerl.engine.openai.responses import chat_response, completion_response
from moerl.engine.openai.stream import chat_events, completion_events
from moerl.engine.validate import check_generate

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def error_response(message: str, status: int = 400, kind: str = "BadRequest") -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def generation_defaults(model_path: str) -> dict[str, Any]:
    """The sampling values the checkpoint's generation_config.json sets (SGLang's
    ``--sampling-defaults model``): chat's defaults when a request leaves them out."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}


def register_openai_routes(app: FastAPI, state: EngineState, body_of: Any) -> None:
    runner, tool_parser = state.runner, state.tool_call_parser
    defaults = generation_defaults(state.model_path)

    @app.get("/v1/models")
    async def models() -> Any:
        """SGLang's ModelList: the served model, then each loaded LoRA adapter."""
        cards = [
            {
                "id": state.model_path,
                "object": "model",
                "created": int(state.started),
                "owned_by": "sglang",
                "root": state.model_path,
                "parent": None,
                "max_model_len": runner.context_len,
            }
        ]
        for name in runner.lora.adapters if runner.lora is not None else []:
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "sglang",
                    "root": name,
                    "parent": state.model_path,
                    "max_model_len": None,
                }
            )
        return JSONResponse({"object": "list", "data": cards})

    async def serve(request: HTTPRequest, call_of: Any, render: Any, events: Any) -> Any:
        try:
            call = call_of(await body_of(request))
            reqs = parse_generate(state, check_generate(call.generate))
        except ValueError as err:
            return error_response(str(err))
        if call.stream:
            items = start_stream(state, reqs)
            return StreamingResponse(events(call, reqs, items), media_type="text/event-stream")
        done = await run_all(state, request, reqs)
        if done is None:
            return Response(status_code=499)  # nobody reads it
        failed = failure(done)
        if failed:
            return error_response(failed[0], failed[1], str(failed[1]))
        rets = [build_response(state, r) for r in done]
        return JSONResponse(render(call, rets, [r.input_ids for r in done]))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Any:
        def call_of(body: dict[str, Any]) -> Call:
            return completion_call(body, state.tokenizer)

        return await serve(request, call_of, completion_response, completion_events)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Any:
        def call_of(body: dict[str, Any]) -> Call:
            return chat_call(body, state.tokenizer, tool_parser, defaults, runner.context_len)

        return await serve(request, call_of, chat_response, chat_events)
