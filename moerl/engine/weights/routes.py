"""Weight-update endpoints: a process group with the trainer, and broadcasts into it.

``/init_weights_update_group`` joins a gloo/NCCL group spanning trainer rank 0 and
the engines (``moerl.engine.weights.group``). ``/update_weights_from_distributed`` receives
the broadcast tensors (one by one, or one ``flattened_bucket``) on a worker thread
while decoding goes on, validates every name and shape, and only then swaps them
into the model between two decode steps — running requests continue on the new
weights and their later tokens carry the new ``weight_version``. A request that
fails validation still receives the broadcast (so the trainer never hangs) and
leaves the model untouched: a wrong name or shape, or a tensor holding NaN or inf (400
naming it). Applied weights flush the prefix cache, whatever the body's ``flush_cache``
says (SGLang keeps its cache on ``false``; here a stale prefix would be wrong KV). A push that states more bytes than twice the model's fp32 size is refused
before receiving anything.

Tensors are received where the group's backend moves them: a gloo group on the CPU, an
NCCL group on the engine's GPU (which needs an engine started with a CUDA ``--device``);
``ModelRunner.load_bucket`` copies them into the model wherever it runs.

``/update_weights_from_tensor`` is the same-host path without a group: the body carries
handles to the sender's shared-memory (or CUDA IPC) tensors (moerl/engine/weights/tensor_payload.py),
checked the same way before the copy. Both loads run only inside SGLang's weight-update
session (``/begin_weight_update`` ... ``/end_weight_update``).

From a load's arrival until its weights are loaded or refused, no waiting generation
request starts (``Scheduler.hold_admission``): a request that arrives after the load's
request starts on its weights, as SGLang's wait on its update lock. A trainer may
therefore send the next requests as soon as the broadcast left it (the engine entered
the broadcast after taking the hold).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from moerl.engine.core.scheduler import settles
from moerl.engine.validate import nonfinite_tensor
from moerl.engine.weights.bucket import dtype_of, nbytes, unflatten
from moerl.engine.weights.group import broadcast, init_custom_process_group
from moerl.engine.weights.tensor_payload import MappedStorages, read_named_tensors


class ReceiveBuffers:
    """Byte buffers that flattened buckets are received into, taken and given back in
    turn (two: one receiving while the model copies from the other)."""

    def __init__(self, count: int = 2, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        for _ in range(count):
            self._free.put_nowait(torch.empty(0, dtype=torch.uint8, device=self.device))

    async def take(self, size: int) -> torch.Tensor:
        """A free buffer of at least ``size`` bytes (whole; waits for one to be given back)."""
        buffer = await self._free.get()
        if buffer.numel() < size:  # grown once to the largest bucket, then reused
            del buffer
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.put_nowait(buffer)


@dataclass
class WeightGroup:
    """A joined weight-update group and what its requests share."""

    group: Any
    device: torch.device  # where its backend receives: the CPU (gloo) or the GPU (NCCL)
    receiving: asyncio.Lock = field(default_factory=asyncio.Lock)  # one receive at a time
    buffers: ReceiveBuffers = field(init=False)
    # (buffer, layout) -> the bucket's tensors as views of that buffer: every push of a
    # model sends the same buckets into the same two buffers (used under ``receiving``)
    views: dict[tuple[Any, ...], list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buffers = ReceiveBuffers(device=self.device)


def receive_device(backend: str, engine: torch.device) -> torch.device:
    """Where a ``backend`` group delivers tensors to an engine running on ``engine``."""
    if backend != "nccl":
        return torch.device("cpu")
    if engine.type != "cuda":
        raise ValueError(
            f"backend 'nccl' receives into GPU memory, and this engine runs on {engine}; "
            "use backend 'gloo', or start the engine with --device cuda"
        )
    return engine


MAX_VIEWS = 16
"""Bucket layouts whose views a group keeps (a push of a model sends a few)."""


def _receive(
    group: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    buffer: torch.Tensor | None,
    device: torch.device,
    views: dict[tuple[Any, ...], list[torch.Tensor]] | None = None,
) -> tuple[list[torch.Tensor], str | None]:
    """The broadcast tensors (views of ``buffer`` for a flattened bucket, else new ones,
    one broadcast each), and the name of the first one holding NaN or inf, if any.
    ``views``: a cache of a flattened bucket's views by buffer and layout."""
    if buffer is not None:
        broadcast(group, buffer)
        key = (buffer.data_ptr(), buffer.numel(), tuple(dtypes), tuple(map(tuple, shapes)))
        tensors = None if views is None else views.get(key)
        if tensors is None:
            tensors = unflatten(buffer, dtypes, shapes)
            if views is not None:
                if len(views) >= MAX_VIEWS:
                    views.clear()
                views[key] = tensors
        if finite_bucket(buffer, dtypes):  # one pass over the bucket, not one per tensor
            return tensors, None
    else:
        tensors = [
            torch.empty(tuple(s), dtype=dtype_of(d), device=device) for d, s in zip(dtypes, shapes)
        ]
        for t in tensors:
            broadcast(group, t)
    return tensors, nonfinite_tensor(zip(names, tensors))


def finite_bucket(buffer: torch.Tensor, dtypes: list[str]) -> bool:
    """Whether a flattened bucket of one floating dtype is all finite, in one pass;
    False also when it holds several dtypes or is not that dtype's multiple (then each
    tensor is checked, and the one with NaN or inf named)."""
    if len(set(dtypes)) != 1:
        return False
    dtype = dtype_of(dtypes[0])
    if not dtype.is_floating_point or buffer.numel() % dtype.itemsize:
        return False
    try:
        values = buffer.view(dtype)
    except RuntimeError:  # an offset that dtype cannot view at
        return False
    return nonfinite_tensor([("bucket", values)]) is None


def _read_and_look(
    serialized: Any, load_format: Any, mapped: MappedStorages
) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """``/update_weights_from_tensor``'s tensors (ValueError: unreadable, or none) and the
    name of the first one holding NaN or inf, if any."""
    named = read_named_tensors(serialized, load_format, mapped)
    if not named:
        raise ValueError("serialized_named_tensors holds no tensors")
    return named, nonfinite_tensor(named)


class _Refused(ValueError):
    """A bucket refused before the model changed; its words go into the answer."""


def _loader(
    state: Any,
    names: list[str],
    shapes: list[Any],
    tensors: list[torch.Tensor],
    bad: str | None,
    version: Any,
    abort_all: bool,
    route: str,
    release: Callable[[], None],
) -> Callable[[], tuple[int, float]]:
    """What ``/update_weights_from_<route>`` runs on the scheduler: names and shapes
    (``ModelRunner.load_targets``, cached per layout), then values (``bad``: the first
    tensor holding NaN or inf) checked before the model changes (``_Refused``
    otherwise); then loaded, the prefix cache flushed (always, whatever the body's
    flush_cache: cached KV is the old weights') and the version set. Returns the count
    and how long decoding was blocked. Either way it ends by calling ``release`` (the
    update's ``Scheduler.hold_admission``), so the requests that arrived meanwhile start
    in the same turn of the scheduler."""
    runner, sched = state.runner, state.scheduler

    def apply() -> tuple[int, float]:
        start = time.perf_counter()
        try:
            try:
                targets = runner.load_targets(names, shapes)
            except ValueError as err:
                raise _Refused(str(err)) from None
            if bad is not None:
                raise _Refused(f"{bad} holds NaN or inf")
            if abort_all:
                sched.abort(abort_all=True, message=f"aborted by update_weights_from_{route}")
            count = runner.copy_into(targets, tensors)
            sched.flush_cache()
            if version is not None:
                sched.weight_version = str(version)
        finally:
            release()
        return count, time.perf_counter() - start

    return apply


RELEASED = (
    "the weights are released (release_memory_occupation): resume_memory_occupation with "
    "tags ['weights'] first"
)


def register_weight_routes(
    app: FastAPI, state: Any, ok: Any, fail: Any, body_of: Any, on_scheduler: Any
) -> None:
    sched, runner = state.scheduler, state.runner
    # a sender's buffers and parameters stay mapped between pushes (tensor_payload says
    # why); up to three times this model's bytes: its parameters plus staging buckets
    model_bytes = sum(p.numel() * p.element_size() for p in runner.params.values())
    mapped = MappedStorages(3 * model_bytes)
    most_bytes = 8 * sum(t.numel() for t in runner.params.values())  # fp64, every parameter

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
        name = body.get("group_name") or "weight_update_group"  # null: the default
        if name in state.groups:
            return fail(f"group {name!r} exists; destroy it first")
        backend = body.get("backend") or "gloo"
        rank = int(body["rank_offset"])  # one rank per engine (tensor-parallel size 1)
        try:
            device = receive_device(backend, runner.device)
        except ValueError as err:
            return fail(f"could not join the weight-update group: {err}")
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
        state.groups[name] = WeightGroup(group, device)
        return ok(f"joined {name!r} as rank {rank} of {body['world_size']} ({backend})")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: HTTPRequest) -> Any:
        body = await body_of(request)
        name = body.get("group_name") or "weight_update_group"  # null: the default
        group = state.groups.pop(name, None)
        if group is None:
            joined = sorted(state.groups) or "none"
            return fail(f"no weight-update group {name!r} to destroy (joined: {joined})")
        del group
        return ok(f"destroyed {name!r}")

    def refuse_load(route: str) -> Any:
        """SGLang's answer to a load outside a weight-update session; a clear one while the
        weights are released; None when the load may go on."""
        if not state.weight_session:
            return fail(f"{route} must run between begin_weight_update() and end_weight_update()")
        return fail(RELEASED) if "weights" in sched.released else None

    # SGLang 0.5.23: weights load only inside a session (it restores in-place-quantized
    # weights at its start and finalizes them at its end); the same answers here.
    @app.post("/begin_weight_update")
    async def begin_weight_update(request: HTTPRequest) -> Any:
        await body_of(request)
        if state.weight_session:
            return fail("a weight-update session is already open; call end_weight_update() first")
        state.weight_session = True
        return ok("Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: HTTPRequest) -> Any:
        await body_of(request)
        if not state.weight_session:
            return fail("no weight-update session is open; call begin_weight_update() first")
        state.weight_session = False
        return ok("Success")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: HTTPRequest) -> Any:
        """SGLang's same-host path: tensors arrive as shared-memory (or CUDA IPC) handles
        in serialized_named_tensors (moerl/engine/weights/tensor_payload.py), checked whole before
        the model changes."""
        body = await body_of(request)
        refused = refuse_load("update_weights_from_tensor")
        if refused is not None:
            return refused
        version = body.get("weight_version")
        abort_all = bool(body.get("abort_all_requests", False))
        release = sched.hold_admission()  # requests arriving from now on start after it
        try:
            try:  # read and looked at for NaN and inf in one hand-off to a worker thread
                named, bad = await asyncio.to_thread(
                    _read_and_look,
                    body.get("serialized_named_tensors"),
                    body.get("load_format"),
                    mapped,
                )
            except ValueError as err:
                return fail(f"weights not applied (model unchanged): {err}")
            names, tensors = [n for n, _ in named], [t for _, t in named]
            shapes = [t.shape for t in tensors]

            # copies: the sender's buffers stay its own
            apply = _loader(
                state, names, shapes, tensors, bad, version, abort_all, "tensor", release
            )
            try:
                count, apply_s = await on_scheduler(state, apply)
            except _Refused as err:
                return fail(f"weights not applied (model unchanged): {err}")
        finally:
            release()
        return ok(f"updated {count} tensors", weight_version=sched.weight_version, apply_s=apply_s)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: HTTPRequest) -> Any:
        body = await body_of(request)
        refused = refuse_load("update_weights_from_distributed")
        if refused is not None:
            return refused
        name = body.get("group_name") or "weight_update_group"  # null: the default
        if name not in state.groups:
            return fail(f"no weight-update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not names or not (len(names) == len(dtypes or []) == len(shapes or [])):
            return fail("names, dtypes and shapes must be non-empty lists of equal length")
        stated = sum(nbytes(dtype_of(d), s) for d, s in zip(dtypes, shapes))
        if stated > most_bytes:
            return fail(f"the push states {stated} bytes, more than this model could hold")
        load_format = body.get("load_format")
        if load_format not in (None, "direct", "flattened_bucket"):
            return fail(f"load_format={load_format!r}: choose null or 'flattened_bucket'")
        version = body.get("weight_version")
        abort_all = bool(body.get("abort_all_requests", False))
        group: WeightGroup = state.groups[name]
        buffer = None
        # requests arriving from now on start on these weights: the trainer may send the
        # next ones once the broadcast left it, since this engine entered it after here
        release = sched.hold_admission()
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[tuple[int, float]] = loop.create_future()

        def receive_and_queue(into: torch.Tensor | None) -> None:
            """On a worker thread: the broadcast, then its loading queued on the scheduler
            from here (not from the event loop, which may be busy reading requests)."""
            tensors, bad = _receive(
                group.group, names, dtypes, shapes, into, group.device, group.views
            )
            apply = _loader(
                state, names, shapes, tensors, bad, version, abort_all, "distributed", release
            )
            sched.control(apply, settles(loop, loaded))

        try:
            async with group.receiving:  # in arrival order, which is the broadcasts' order
                if load_format == "flattened_bucket":
                    buffer = await group.buffers.take(stated)
                await asyncio.to_thread(
                    receive_and_queue, None if buffer is None else buffer[:stated]
                )
            try:
                count, apply_s = await loaded
            except _Refused as err:
                return fail(f"weights not applied (model unchanged): {err}")
        finally:  # the model copied the bucket out of the buffer (or never will)
            release()
            if buffer is not None:
                group.buffers.give(buffer)
        # apply_s: how long decoding was blocked (the swap between two decode steps)
        return ok(f"updated {count} tensors", weight_version=sched.weight_version, apply_s=apply_s)
