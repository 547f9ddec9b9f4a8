"""The embedded engine's HTTP app: SGLang's native API subset (docs/architecture.md,
"The engine protocol").

FastAPI + uvicorn, as SGLang uses. Handlers validate, hand work to the
``Scheduler`` thread and await the result. Nothing received over the network is
unpickled but by ``/update_weights_from_tensor``'s restricted reader: weights arrive over a
torch.distributed group or as shared-memory handles, adapters as safetensors.

Every body is checked by ``moerl.engine.validate`` before it reaches the scheduler (400
naming the field). Limits as SGLang's: a full queue (--max-queued-requests) or a scheduler
that stopped answers 503 at once; a client that disconnects aborts its requests, streaming
or not. ``/health`` is 503 with the reason once the scheduler thread ended;
``/health_generate`` generates one token. The API key (--api-key, or the MOERL_API_KEY
environment variable) guards every endpoint but the health checks, as SGLang's does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from moerl.engine.core.sampling import SamplingParams, UnknownFieldError
from moerl.engine.core.scheduler import Request, Unavailable, new_rid, settles
from moerl.engine.core.state import EngineState
from moerl.engine.native.generate import (
    GenerateResponse,
    build_response,
    failure,
    parse_generate,
    resolve_on,
    run_all,
    stream_response,
)
from moerl.engine.validate import MEMORY_TAGS, check_control, check_generate, is_batch

log = logging.getLogger(__name__)

# SGLang's name and default: seconds /health_generate waits for its token
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))

BODY_OPTIONAL = (
    "/begin_weight_update",
    "/end_weight_update",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)
"""Control routes whose fields all have defaults: an empty body means all defaults."""


def ok(message: str = "", **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


def error_response(message: str, status: int = 400) -> JSONResponse:
    if status >= 500:  # SGLang's ErrorResponse, as its HTTPException handler sends it
        body = {"object": "error", "message": message, "type": str(status), "param": None}
        return JSONResponse({**body, "code": status}, status_code=status)
    return JSONResponse({"error": {"message": message}}, status_code=status)


class ApiKeyMiddleware:
    """Bearer-token check as plain ASGI (a BaseHTTPMiddleware would hide client
    disconnects from the handlers); /health* stays open for probes, as in SGLang."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/health"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    "invalid or missing API key (Authorization: Bearer KEY)", 401
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def on_scheduler(state: EngineState, fn: Any) -> Any:
    """Run ``fn`` on the scheduler thread between steps and await its result."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    state.scheduler.control(fn, settles(loop, future))
    return await future


def create_app(state: EngineState) -> FastAPI:
    app = FastAPI(title="moerl embedded engine", docs_url=None, redoc_url=None)
    sched, runner = state.scheduler, state.runner

    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)

    async def body_of(request: HTTPRequest) -> dict[str, Any]:
        if request.url.path in BODY_OPTIONAL and not (await request.body()).strip():
            return {}
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            raise ValueError(f"request body is not JSON: {err}") from None
        except RecursionError:
            raise ValueError("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        if request.url.path != "/generate":
            check_control(request.url.path, body)
        return body

    @app.exception_handler(ValueError)
    async def bad_request(request: HTTPRequest, err: ValueError) -> JSONResponse:
        if isinstance(err, UnknownFieldError):
            return JSONResponse({"error": str(err)}, status_code=400)
        return error_response(str(err), 400)

    @app.exception_handler(Unavailable)
    async def unavailable(request: HTTPRequest, err: Unavailable) -> JSONResponse:
        return error_response(str(err), 503)

    @app.exception_handler(Exception)
    async def internal(request: HTTPRequest, err: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path)
        return error_response(f"internal error: {type(err).__name__}: {err}"[:2000], 500)

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> Any:
        body = check_generate(await body_of(request))
        reqs = parse_generate(state, body)
        several = is_batch(body) or len(reqs) > 1  # SGLang answers these with a list
        if body.get("stream"):
            return stream_response(state, reqs, indexed=several)
        done = await run_all(state, request, reqs)
        if done is None:
            return Response(status_code=499)  # nobody reads it
        failed = failure(done)
        if failed:
            return error_response(*failed)
        out = [build_response(state, r) for r in done]
        if not several:
            return GenerateResponse(out[0])
        for i, item in enumerate(out):
            item["index"] = i
        return GenerateResponse(out)

    @app.get("/health")
    async def health() -> Any:
        if sched.dead is not None or not sched.thread.is_alive():
            return error_response(sched.dead or "the scheduler thread is not running", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        """As SGLang's: 200 once the engine generated one token for a probe request."""
        if sched.paused:
            return error_response(
                "generation is paused (POST /continue_generation resumes it)", 503
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Request] = loop.create_future()
        req = Request(
            rid=f"HEALTH_CHECK_{new_rid()}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0),
        )
        req.on_done = resolve_on(loop, future)
        sched.submit(req, bounded=False)
        try:
            await asyncio.wait_for(future, timeout=HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            sched.cancel([req], "health check timed out")
            return error_response(f"no token generated within {HEALTH_CHECK_TIMEOUT_S:g} s", 503)
        reason = req.finish_reason or {}
        if reason.get("type") == "abort" or len(req.output_ids) != 1:
            return error_response(
                f"the probe request did not generate: {reason.get('message')}", 503
            )
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
        cfg = runner.config
        return {
            "model_path": state.model_path,
            "served_model_name": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "load_format": "auto",
            "architectures": list(getattr(cfg, "architectures", None) or []),
            "weight_version": sched.weight_version,
            "num_hidden_layers": runner.num_layers,
            "num_experts_per_tok": runner.topk,
            "vocab_size": runner.vocab_size,
            "context_length": runner.context_len,
            "model_type": getattr(cfg, "model_type", None),
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Any:
        return JSONResponse(model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        from moerl.engine.native.info import server_info

        return JSONResponse(server_info(state, model_info()))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        # Unlike SGLang's, never refused while requests run: each owns its KV cache, and
        # one admitted before the flush is not cached when it ends.
        await on_scheduler(state, sched.flush_cache)
        return PlainTextResponse("Cache flushed.")

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc_route() -> Any:
        # SGLang's /freeze_gc: the objects alive now leave the garbage collector's scans
        # (moerl/common/gc_freeze.py); the scheduler thread waits for the one collection
        from moerl.common.gc_freeze import freeze_gc

        count, seconds = freeze_gc()
        log.info("froze the garbage collector's %d objects in %.2f s", count, seconds)
        return PlainTextResponse("Garbage collection frozen.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest) -> Any:
        body = await body_of(request)
        mode = body.get("mode", "abort")
        await on_scheduler(state, lambda: sched.pause(mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        await on_scheduler(state, sched.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest) -> Any:
        body = await body_of(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if rid or abort_all:  # SGLang ignores an empty rid without abort_all
            await on_scheduler(state, lambda: sched.abort(rid=rid, abort_all=abort_all))
        return Response(status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest) -> Any:
        body = await body_of(request)
        version = body.get("new_version")
        if version is None:
            raise ValueError("update_weight_version needs new_version")
        abort_all = bool(body.get("abort_all_requests", True))  # SGLang's default

        def apply() -> None:
            if abort_all:
                sched.abort(abort_all=True, message="aborted by update_weight_version")
            sched.weight_version = str(version)

        await on_scheduler(state, apply)
        return ok(f"weight version is {version}", new_version=str(version))

    # SGLang's memory release for colocation (tags weights, kv_cache, cuda_graph; none =
    # all): success answers null, as SGLang's handlers return nothing
    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: HTTPRequest) -> Any:
        body = await body_of(request) if request.method == "POST" else {}
        tags = list(body.get("tags") or MEMORY_TAGS)
        await on_scheduler(state, lambda: sched.release_memory(tags))
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: HTTPRequest) -> Any:
        body = await body_of(request) if request.method == "POST" else {}
        tags = list(body.get("tags") or sorted(sched.released))
        await on_scheduler(state, lambda: sched.resume_memory(tags))
        return JSONResponse(None)

    from moerl.engine.lora.routes import register_lora_routes
    from moerl.engine.openai.api import register_openai_routes
    from moerl.engine.weights.routes import register_weight_routes

    register_lora_routes(app, state, body_of, on_scheduler)
    register_openai_routes(app, state, body_of)

    register_weight_routes(app, state, ok, fail, body_of, on_scheduler)
    return app
