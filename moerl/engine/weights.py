"""Weight-update endpoints: a process group with the trainer, and broadcasts into it.

``/init_weights_update_group`` joins a gloo/NCCL group spanning trainer rank 0 and
the engines (``moerl.engine.group``). ``/update_weights_from_distributed`` receives
the broadcast tensors (one by one, or one ``flattened_bucket``) on a worker thread
while decoding goes on, validates every name and shape, and only then swaps them
into the model between two decode steps — running requests continue on the new
weights and their later tokens carry the new ``weight_version``. A request that
fails validation still receives the broadcast (so the trainer never hangs) and
leaves the model untouched: a wrong name or shape, or a tensor holding NaN or inf (400
naming it). Applied weights flush the prefix cache, whatever the body's ``flush_cache``
says (SGLang keeps its cache on ``false``; here a stale prefix would be wrong KV). A push that states more bytes than twice the model's fp32 size is refused
before receiving anything.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from moerl.engine.bucket import dtype_of, empty_bucket, nbytes, unflatten
from moerl.engine.group import broadcast, init_custom_process_group
from moerl.engine.validate import nonfinite_tensor


def _receive(
    group: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    load_format: str | None,
) -> list[torch.Tensor]:
    if load_format == "flattened_bucket":
        buffer = empty_bucket(dtypes, shapes)
        broadcast(group, buffer)
        return unflatten(buffer, dtypes, shapes)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format={load_format!r}: choose null or 'flattened_bucket'")
    tensors = [torch.empty(tuple(s), dtype=dtype_of(d)) for d, s in zip(dtypes, shapes)]
    for t in tensors:
        broadcast(group, t)
    return tensors


def register_weight_routes(
    app: FastAPI, state: Any, ok: Any, fail: Any, body_of: Any, on_scheduler: Any
) -> None:
    sched, runner = state.scheduler, state.runner

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: HTTPRequest) -> Any:
        body = await body_of(request)
        missing = [
            k
            for k in ("master_address", "master_port", "rank_offset", "world_size")
            if k not in body
        ]
        if missing:
            raise ValueError(f"init_weights_update_group needs {missing}")
        name = body.get("group_name", "weight_update_group")
        if name in state.groups:
            return fail(f"group {name!r} exists; destroy it first")
        backend = body.get("backend") or "gloo"
        rank = int(body["rank_offset"])  # one rank per engine (tensor-parallel size 1)
        try:
            group = await asyncio.to_thread(
                init_custom_process_group,
                backend,
                body["master_address"],
                int(body["master_port"]),
                rank,
                int(body["world_size"]),
            )
        except Exception as err:  # a wrong address or a trainer that never joined
            return fail(f"could not join the weight-update group: {err}")
        state.groups[name] = group
        return ok(f"joined {name!r} as rank {rank} of {body['world_size']} ({backend})")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: HTTPRequest) -> Any:
        body = await body_of(request)
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        if group is None:
            return fail(f"no weight-update group {name!r}")
        del group
        return ok(f"destroyed {name!r}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: HTTPRequest) -> Any:
        body = await body_of(request)
        name = body.get("group_name", "weight_update_group")
        if name not in state.groups:
            return fail(f"no weight-update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not names or not (len(names) == len(dtypes or []) == len(shapes or [])):
            return fail("names, dtypes and shapes must be non-empty lists of equal length")
        stated = sum(nbytes(dtype_of(d), s) for d, s in zip(dtypes, shapes))
        if stated > 8 * sum(t.numel() for t in runner.params.values()):
            return fail(f"the push states {stated} bytes, more than this model could hold")
        tensors = await asyncio.to_thread(
            _receive, state.groups[name], names, dtypes, shapes, body.get("load_format")
        )
        try:
            runner.check_weights(names, shapes)
        except ValueError as err:
            return fail(f"weights not applied (model unchanged): {err}")
        bad = await asyncio.to_thread(nonfinite_tensor, zip(names, tensors))
        if bad is not None:
            return fail(f"weights not applied (model unchanged): {bad} holds NaN or inf")
        version = body.get("weight_version")
        abort_all = bool(body.get("abort_all_requests", False))

        def apply() -> tuple[int, float]:
            start = time.perf_counter()
            if abort_all:
                sched.abort(abort_all=True, message="aborted by update_weights_from_distributed")
            count = runner.load_weights(zip(names, tensors))
            # always, whatever the body's flush_cache: cached KV is the old weights'
            sched.flush_cache()
            if version is not None:
                sched.weight_version = str(version)
            return count, time.perf_counter() - start

        count, apply_s = await on_scheduler(state, apply)
        # apply_s: how long decoding was blocked (the swap between two decode steps)
        return ok(f"updated {count} tensors", weight_version=sched.weight_version, apply_s=apply_s)
