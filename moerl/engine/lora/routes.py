"""LoRA endpoints, with SGLang's response shape
``{"success", "error_message", "loaded_adapters"}``."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from moerl.engine.lora.adapters import read_peft_dir
from moerl.engine.validate import check_peft_config, nonfinite_tensor
from moerl.engine.weights.tensor_payload import read_named_tensors


def register_lora_routes(app: FastAPI, state: Any, body_of: Any, on_scheduler: Any) -> None:
    runner, sched = state.runner, state.scheduler

    def reply(ok: bool, error: str = "") -> JSONResponse:
        loaded = {n: "" for n in runner.lora.adapters} if runner.lora is not None else {}
        body = {"success": ok, "error_message": error, "loaded_adapters": loaded}
        return JSONResponse(body, status_code=200 if ok else 400)

    disabled = "LoRA is disabled: start the server with --enable-lora"

    async def apply(fn: Any) -> JSONResponse:
        if runner.lora is None:
            return reply(False, disabled)
        try:
            await on_scheduler(state, fn)  # between decode steps: no half-applied adapter
        except ValueError as err:
            return reply(False, str(err))
        return reply(True)

    async def load(name: str, config: dict[str, Any], tensors: dict[str, Any]) -> JSONResponse:
        """Refuse a config the engine cannot read and non-finite tensors, then load."""
        if not isinstance(config, dict):
            return reply(False, f"adapter {name!r}: adapter_config must be a JSON object")
        try:
            check_peft_config(config)
        except ValueError as err:
            return reply(False, f"adapter {name!r}: {err}")
        bad = await asyncio.to_thread(nonfinite_tensor, tensors.items())
        if bad is not None:
            return reply(False, f"adapter {name!r}: {bad} holds NaN or inf; nothing loaded")

        def load_it() -> None:
            runner.lora.load(name, config, tensors)
            sched.flush_adapter(name)  # a name loaded anew: its cached KV is stale

        return await apply(load_it)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: HTTPRequest) -> Any:
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return reply(False, "load_lora_adapter needs lora_name and lora_path")

        if runner.lora is None:
            return reply(False, disabled)
        try:  # read off the scheduler thread; only the swap waits between decode steps
            config, tensors = await asyncio.to_thread(read_peft_dir, path)
        except Exception as err:  # missing, truncated or not safetensors: refuse, load nothing
            return reply(False, f"cannot read the adapter at {path}: {err}")
        return await load(name, config, tensors)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: HTTPRequest) -> Any:
        from safetensors.torch import load as safetensors_load

        body = await body_of(request)
        name, config, blob = (
            body.get("lora_name"),
            body.get("config_dict"),
            body.get("safetensors_b64"),
        )
        handles = body.get("serialized_named_tensors")
        if not name or not isinstance(config, dict) or (blob is None) == (handles is None):
            return reply(
                False,
                "needs lora_name, config_dict (PEFT adapter_config) and the tensors as one of "
                "serialized_named_tensors (SGLang's: tensor handles, one dump per TP rank) or "
                "safetensors_b64 (moerl's: a base64 safetensors file, from any host)",
            )
        if handles is not None:  # same host: read with the restricted unpickler
            try:
                named = await asyncio.to_thread(
                    read_named_tensors, handles, body.get("load_format")
                )
            except ValueError as err:
                return reply(False, str(err))
            # copies: the sender's shared buffers stay its own (it may write them again)
            return await load(name, config, {n: t.clone() for n, t in named})
        if not isinstance(blob, str):
            return reply(False, "safetensors_b64 must be a base64 string")
        try:
            tensors = safetensors_load(base64.b64decode(blob, validate=True))
        except Exception as err:  # safetensors or nothing: never unpickled
            return reply(False, f"safetensors_b64 is not a base64 safetensors file: {err}")
        return await load(name, config, tensors)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: HTTPRequest) -> Any:
        body = await body_of(request)
        name = body.get("lora_name")
        if name is None:
            return reply(False, "unload_lora_adapter needs lora_name")

        def unload() -> None:
            # Refused while any request (running, retracted, or still waiting to start)
            # generates with it, as SGLang refuses: a request never switches adapter.
            waiting = sum(1 for r in sched.queued_requests() if r.lora == name and not r.done)
            busy = sched.uses_adapter(name) + waiting
            if busy:
                raise ValueError(
                    f"adapter {name!r} is used by {busy} running or waiting requests; "
                    f"retry when they finish, or load the next version under a new name"
                )
            runner.lora.unload(name)
            sched.flush_adapter(name)

        return await apply(unload)
