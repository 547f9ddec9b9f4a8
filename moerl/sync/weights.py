"""Full-weight sync, trainer side: stream every HF-named tensor to the engines in buckets.

Every trainer rank calls ``connect()``, ``push(version)`` and ``close()`` together.
Global rank 0 alone talks HTTP and owns the custom group (trainer = rank 0, engines
at rank offsets 1, 2, …; ``moerl.engine.weights.group``). Each pipeline stage's ranks iterate
``export_hf`` in lockstep (it gathers TP/EP shards collectively); the stage's lowest
global rank gathers the tensors straight into two reused buffers, buckets of at most
``bucket_mb`` (a larger tensor goes alone), and, for stages other than rank 0's, sends
them to rank 0 point-to-point over the default group, one bucket at a time
(``moerl.sync.stream``); other stages wait their turn, blocked in that send. Rank 0
forwards each bucket to every engine as one ``flattened_bucket`` broadcast announced by
the engines' ``/update_weights_from_distributed`` (which returns once the engine has
received and loaded the bucket), gathering the next bucket while this one is on the
wire and sending it before the engines have loaded this one (``moerl.sync.wire``).
The last bucket carries ``weight_version``, so the version changes with the last swap.

The engines' HTTP calls are coroutines. A synchronous trainer runs them through
``run_coro(coro) -> concurrent.futures.Future``; by default a private event-loop
thread on rank 0 (``asyncio.run_coroutine_threadsafe``). An orchestrator that already
runs an event loop passes its own ``client`` and ``run_coro`` bound to that loop.

Buckets are applied by the engines as they arrive (SGLang does the same): between two
buckets an engine serves a mix of old and new tensors unless it was paused first.
An error on rank 0 mid-push leaves other stages' leads blocked in their send until the
default group's timeout: treat it as fatal for the job (torchrun stops the others).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl import device
from moerl.engine.weights.bucket import dtype_of
from moerl.engine.weights.group import init_custom_process_group
from moerl.parallel.full_state import live_tensors
from moerl.rollout.aio import EventLoopThread
from moerl.rollout.client import EngineClient
from moerl.rollout.errors import EngineError
from moerl.sync.plan import PushPlan
from moerl.sync.stream import (
    Bucket,
    Staging,
    bucketize,
    p2p_device,
    receive_buckets,
    send_bucket,
    stage_leads,
)
from moerl.sync.tensor_wire import (
    TensorWire,
    all_in_process,
    share_cpu_tensors,
    share_parameters,
)
from moerl.sync.wire import Layout, WeightSyncError, Wire

__all__ = ["WeightSync", "WeightSyncError"]

RunCoro = Callable[[Coroutine[Any, Any, Any]], "concurrent.futures.Future[Any]"]

_GROUP_FIX = (
    "every engine must reach master_address:master_port of trainer rank 0 (set "
    "master_address to an address of that host the engines can route to, and open the port)"
)

log = logging.getLogger(__name__)

Borrow = Callable[[torch.Tensor], bool] | None  # what the wire reads in place (bucketize)

TENSOR_PATH = "tensor path"  # _group's value once a tensor-transport sync is connected


@dataclass
class Staged:
    """A push gathered by ``WeightSync.stage``: every bucket, in order, in buffers held
    for it, and the seconds the gathering took."""

    buckets: list[tuple[Bucket, bool]]
    seconds: float


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _alone() -> bool:
    """A world of one rank (or none): an export gathers nothing."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def kept_names(modules: Sequence[str]) -> Callable[[str], bool] | None:
    """Whether a tensor name lies in one of ``modules`` (dotted names such as
    ``gate.weight`` or ``e_score_correction_bias``, matched on whole components as
    transformers matches its ``_keep_in_fp32_modules``); None for no modules."""
    if not modules:
        return None
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(m) for m in modules) + r")(\.|$)")
    return lambda name: pattern.search(name) is not None


def fp32_modules(model_path: str | Path) -> list[str]:
    """The modules transformers keeps in float32 for the checkpoint at ``model_path``
    (its class's ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict``): an
    engine built on transformers holds them so, whatever its dtype. [] when the
    checkpoint's architecture is not one transformers knows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return []
    names: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names += [m for m in getattr(cls, attr, None) or [] if m not in names]
    return names


class WeightSync:
    """Trainer side of full-weight sync; every trainer rank builds one and calls its methods.

    Args:
        chunks: this rank's model chunks (``build_model``).
        model_cfg: the ``ModelConfig`` they were built from (names and layouts for export).
        client: an ``EngineClient`` for the engines (rank 0 only); else one is made from ``urls``.
        urls: engine base URLs, when no ``client`` is given (ignored on other ranks).
        bucket_mb: bucket size in MiB; a tensor bigger than a bucket is sent alone.
        dtype: cast tensors to this dtype before sending (e.g. "bfloat16" for a bf16
            engine: half the bytes); None sends the trainer parameters' own dtype.
        backend: the custom group's backend, "gloo" (CPU tensors) or "nccl" (GPU tensors).
        master_address: an address of trainer rank 0 that every engine can reach.
        master_port: the custom group's TCP store port on rank 0; None picks a free one.
        group_name: the engines' name for the group (several syncs can coexist).
        run_coro: schedules a coroutine on the event loop ``client`` lives on and returns a
            ``concurrent.futures.Future``; None starts a private loop thread on rank 0.
        timeout_s: how long joining the group or one broadcast may take.
        flush_cache: ask the engines to flush their prefix cache with the last bucket; False
            while requests stay in flight through the update (in-place partial rollouts:
            SGLang refuses a flush with running requests).
        transport: "broadcast" (the custom group, /update_weights_from_distributed) or
            "tensor" (same host: handles to shared buckets, /update_weights_from_tensor;
            moerl/sync/tensor_wire.py); the backend and master_* then go unused.
        keep_dtype: module names (transformers' ``_keep_in_fp32_modules``, e.g.
            ``gate.weight``) whose tensors are sent in their own dtype whatever ``dtype``
            says: the engine keeps them in float32, and a bf16 push would round them.
        keep_session: keep the engines' weight-update session open from the first push
            to ``close()`` (moerl's own engines: their session only gates the loads, so a
            push is then one round trip per bucket); False opens and closes one per push,
            as SGLang's servers need (``end_weight_update`` finalizes what was loaded).
            A failed push closes it; the next push opens it again.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        model_cfg: Any,
        *,
        client: EngineClient | None = None,
        urls: Sequence[str] | None = None,
        bucket_mb: float = 64,
        dtype: str | torch.dtype | None = None,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "moerl_weights",
        run_coro: RunCoro | None = None,
        timeout_s: float = 300.0,
        flush_cache: bool = True,
        transport: str = "broadcast",
        keep_dtype: Sequence[str] = (),
        keep_session: bool = False,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be positive (64 is a good default)")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: choose 'gloo' or 'nccl'")
        if transport not in ("broadcast", "tensor"):
            raise ValueError(f"transport={transport!r}: choose 'broadcast' or 'tensor'")
        self.flush_cache, self.transport = flush_cache, transport
        self._tp_sizes: dict[str, int] = {}
        if transport == "tensor":
            share_cpu_tensors()
        self.chunks, self.model_cfg = chunks, model_cfg
        self.limit_bytes = max(1, int(bucket_mb * 2**20))
        self.dtype = None if dtype is None else dtype_of(dtype)
        self.keep = kept_names(keep_dtype)
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.master_address, self.master_port = master_address, master_port
        self.rank = _rank()
        self.client: EngineClient | None = None
        self._own_client = False
        self._loop: EventLoopThread | None = None
        self._run = run_coro
        self._group: Any = None
        self._broken = False
        self._leads: dict[int, int] | None = None
        # reused by every push; (device, True): stage()'s, one buffer per bucket
        self._staging: dict[tuple[torch.device, bool], Staging] = {}
        self._plan: PushPlan | None = None  # a world of one's push, replayed
        self.keep_session = keep_session
        self._session_open = False  # keep_session: the engines' session is open
        self._first: Layout | None = None  # the last push's first bucket, as sent
        self._announced: tuple[int, Wire] | None = None  # announce()'s version and wire
        if self.rank != 0:
            return
        if client is None:
            if not urls:
                raise ValueError("WeightSync needs client= or urls= (the engines) on rank 0")
            client, self._own_client = EngineClient(list(urls), max_retries=2), True
        self.client = client
        if transport == "tensor" and not all_in_process(client):  # engines read them in place
            share_parameters(chunks)
        if self._run is None:
            self._loop = EventLoopThread("moerl-weight-sync")
            self._run = self._loop.submit

    # ---- connect / close ------------------------------------------------------------------

    def connect(self) -> None:
        """Collective: rank 0 joins the custom group with every engine; other ranks learn
        whether that worked (every rank raises the same error if not)."""
        error = None
        if self.rank == 0:
            try:
                self._connect()
            except Exception as err:  # raised on every rank below, with rank 0's words
                error = err
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(box, src=0)
            if error is None and box[0] is not None:
                raise WeightSyncError(f"weight sync could not connect on rank 0: {box[0]}")
        if error is not None:
            raise error

    def _connect(self) -> None:
        from moerl.parallel.spawn import free_port

        if self._group is not None:
            raise WeightSyncError(f"group {self.group_name!r} is already connected")
        assert self.client is not None and self._run is not None
        urls = self.client.urls
        try:  # fail fast, naming the URL, before anyone waits on the group
            info = self._run(self.client.server_info()).result(timeout=self.timeout_s)
        except Exception as err:
            raise WeightSyncError(f"weight sync cannot reach its engines: {err}") from err
        # an SGLang server with tensor parallelism joins as tp_size ranks
        sizes = [int(info[u].get("tp_size", 1) or 1) for u in urls]
        if self.transport == "tensor":  # no group: each push hands over handles
            self._tp_sizes, self._group = dict(zip(urls, sizes)), TENSOR_PATH
            return
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        world = 1 + sum(sizes)
        port = self.master_port or free_port()
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = init_custom_process_group(
                    self.backend, self.master_address, port, 0, world, self.timeout_s
                )
            except Exception as err:
                box["error"] = err

        joiner = threading.Thread(target=join, name="moerl-weight-group", daemon=True)
        joiner.start()
        http = self._run(
            self.client.init_weights_update_group(
                self.master_address, port, offsets, world, self.group_name, self.backend
            )
        )
        try:
            http.result(timeout=self.timeout_s + 30)
        except Exception as err:
            raise WeightSyncError(
                f"engines could not join weight group {self.group_name!r} at "
                f"{self.master_address}:{port} ({urls}): {err}. Fix: {_GROUP_FIX}"
            ) from err
        joiner.join(timeout=self.timeout_s)
        if "group" not in box:
            raise WeightSyncError(
                f"trainer rank 0 could not host weight group {self.group_name!r} on "
                f"{self.master_address}:{port}: {box.get('error', 'timed out')}. Fix: {_GROUP_FIX}"
            )
        self._group = box["group"]

    def close(self) -> None:
        """Destroy the group on the engines and stop the private loop (rank 0; not collective)."""
        if self.rank != 0:
            return
        if self._announced is not None:
            self._complete_announced()
        error = None
        if self._session_open and self._run is not None:  # a restarted engine has none
            self._end_session(quiet=True, level=logging.INFO)
        if self._group is TENSOR_PATH:
            self._group = None
        if self._group is not None and self.client is not None and self._run is not None:
            self._group, self._broken = None, False
            try:
                self._run(self.client.destroy_weights_update_group(self.group_name)).result(60)
            except Exception as err:  # still stop the loop; report afterwards
                error = err
        if self._own_client and self.client is not None and self._run is not None:
            self._run(self.client.aclose()).result(60)
            self._own_client = False
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if error is not None:
            raise WeightSyncError(f"destroying weight group {self.group_name!r}: {error}")

    def _complete_announced(self) -> None:
        """Closing with an announced push not sent (the step between failed): send it
        with the weights as they are, so the engines leave its broadcast before the group
        goes (a world of one: ``push`` needs no other rank). A failure is logged."""
        assert self._announced is not None
        version = self._announced[0]
        try:
            self.push(version)
        except Exception as err:
            log.warning("completing the announced push of version %d: %s", version, err)
        self._announced = None

    def __enter__(self) -> WeightSync:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- push -----------------------------------------------------------------------------

    def push(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Collective: send every weight to every engine; tokens after the last bucket carry
        ``str(version)``. ``named`` replaces this rank's ``export_hf`` stream with other
        ``(hf_name, tensor)`` pairs (tools, tests). Returns ``{"bytes", "buckets",
        "tensors", "seconds"}``: totals on rank 0, this rank's own sends elsewhere; rank
        0's also says whether the push was ``announced`` (1.0) or not (0.0).
        On CPU it runs without the CPU layer's per-op mode: export, staging and the
        broadcast name no CUDA device (moerl/compat/device_mode.py).

        ``on_ready`` (rank 0) is called, once, as soon as a generation request sent to
        the engines would start on the pushed weights: where ``early_ready``, once the
        last bucket is off the wire, before the engines' answers (a request that reaches
        them after they entered its broadcast waits until it is loaded); else once the
        push landed. When the push then fails, it was called all the same."""
        from moerl.compat import device_mode

        with device_mode.suspended():
            stats = self._push(version, named, on_ready=on_ready)
        assert isinstance(stats, dict)
        return stats

    @property
    def lands_apart(self) -> bool:
        """Whether a push can land apart from its sending (``push_sent`` returns before
        the engines load it): a broadcast; the tensor path's engines read rank 0's
        buffers in place, so it lands before it returns."""
        return self.transport == "broadcast"

    @property
    def early_ready(self) -> bool:
        """Whether ``push``'s ``on_ready`` comes before the engines answer: a broadcast
        to moerl's own engines (``keep_session``), which hold every generation request
        that arrives while a pushed bucket loads until it is loaded
        (``Scheduler.hold_admission``). SGLang's hold theirs too, but finish loading when
        the session ends (``end_weight_update``), after the answers."""
        return self.lands_apart and self.keep_session

    def push_sent(
        self, version: int, named: Iterable[tuple[str, torch.Tensor]] | None = None
    ) -> concurrent.futures.Future[dict[str, float]]:
        """Collective, as ``push``, but returns once the last bucket has left rank 0's
        buffers (the trainer may change its parameters then); the engines' loading of
        the last buckets, the session's end and the version tag complete on the engines'
        event loop (``run_coro``) while the caller goes on. The future holds ``push``'s
        stats (``seconds`` up to the landing) or its error; the next push, and anything
        that needs the engines on ``version``, must wait for it first. A push that cannot
        be split (``transport="tensor"``: the engines read rank 0's parameters in place)
        lands before this returns; other ranks get a done future of their own stats."""
        from moerl.compat import device_mode

        with device_mode.suspended():
            sent = self._push(version, named, detach=self.lands_apart)
        if isinstance(sent, concurrent.futures.Future):
            return sent
        done: concurrent.futures.Future[dict[str, float]] = concurrent.futures.Future()
        done.set_result(sent)
        return done

    def _push(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]] | None,
        detach: bool = False,
        on_ready: Callable[[], None] | None = None,
    ) -> dict[str, float] | concurrent.futures.Future[dict[str, float]]:
        """``detach`` (rank 0, broadcast): the landing's future, as ``push_sent`` says;
        ``on_ready``: as ``push`` says."""
        from moerl.convert.exporter import export_hf

        start = time.perf_counter()
        if self.rank == 0 and (self._group is None or self._broken):
            raise WeightSyncError(
                "push() needs a connected, intact group: call connect() on every rank first"
                + (" (the last push broke it: close() and connect() again)" if self._broken else "")
            )
        leads = self._stage_leads()
        stats = {"bytes": 0.0, "buckets": 0.0, "tensors": 0.0, "seconds": 0.0}
        views = named is None  # an export of our own: split tensors as views (copied here)
        stream = (
            export_hf(self.chunks, self.model_cfg, views=True) if named is None else iter(named)
        )
        if self.rank == 0:
            announced = float(self._announced is not None)
            sent = self._forward(
                self._sources(stream, leads, plan=views), version, detach=detach, start=start,
                on_ready=on_ready,
            )  # fmt: skip
            if isinstance(sent, concurrent.futures.Future):
                return sent
            stats.update(sent, announced=announced)
        elif self.rank in leads:
            staging = self._staging_on(p2p_device())
            for bucket, last in bucketize(
                stream, self.limit_bytes, self.dtype, staging, keep=self.keep
            ):
                send_bucket(bucket, last, dst=0)
                stats["bytes"] += bucket.nbytes
                stats["buckets"] += 1 if bucket.names else 0
                stats["tensors"] += len(bucket.names)
        else:
            for _ in stream:  # take part in the stage's gathers
                pass
        stats["seconds"] = time.perf_counter() - start
        return stats

    # ---- a push in two halves: gathered now, sent while the trainer steps on -----------

    def can_stage(self) -> bool:
        """Collective: whether ``stage``/``send_staged`` can split a push (one pipeline
        stage: rank 0 gathers every bucket itself, the other ranks only take part in the
        export's gathers)."""
        return self._stage_leads() == [0]

    def stage(self, named: Iterable[tuple[str, torch.Tensor]] | None = None) -> Staged | None:
        """Collective: gather every weight into buffers held for this push (rank 0; the
        other ranks take part in the export and get None). ``send_staged`` then sends them
        from any thread of rank 0 while the trainer changes its parameters. Costs one copy
        of the weights (in the sync dtype) held on rank 0, reused by every push."""
        from moerl.compat import device_mode
        from moerl.convert.exporter import export_hf

        if not self.can_stage():
            raise WeightSyncError(
                "a staged push needs one pipeline stage (parallel.pp=1): set sync.overlap=false"
            )
        start = time.perf_counter()
        with device_mode.suspended():
            stream = (
                export_hf(self.chunks, self.model_cfg, views=True) if named is None else iter(named)
            )
            if self.rank != 0:
                for _ in stream:  # take part in the stage's gathers
                    pass
                return None
            held = self._staging_on(self._comm(), hold=True)
            held.rewind()
            buckets = list(bucketize(stream, self.limit_bytes, self.dtype, held, keep=self.keep))
        return Staged(buckets, time.perf_counter() - start)

    def send_staged(self, staged: Staged, version: int) -> dict[str, float]:
        """Rank 0, any thread: send what ``stage`` gathered, as ``push`` would (same
        session, wire, errors and stats; ``seconds`` counts the gathering too). The next
        ``stage`` must wait for this to return: it writes the same buffers."""
        from moerl.compat import device_mode

        start = time.perf_counter()
        if self._group is None or self._broken:
            raise WeightSyncError(
                "send_staged() needs a connected, intact group: close() and connect() again"
            )
        with device_mode.suspended():
            stats = self._forward(lambda _: [iter(staged.buckets)], version)
        assert isinstance(stats, dict)
        return {**stats, "seconds": staged.seconds + time.perf_counter() - start}

    # ---- the next push's first request, posted while the trainer still steps ------------

    def announce(self, version: int, step_s: float) -> bool:
        """Rank 0, before the step whose weights push ``version`` sends: post that push's
        first bucket request now (the last push's first bucket, as every push of the same
        model lays it out), so the engines are inside its broadcast when the step ends and
        the push's first bytes leave at once; requests reaching them meanwhile wait for
        the pushed weights, as during any push. Only for a world of one rank whose
        pushes replay their plan (``push`` then needs no other rank and no export, so
        ``close`` can always complete it), a broadcast to moerl's own engines (their
        session is kept open) and a step of ``step_s`` seconds well inside the group's
        timeout. True when announced; the next ``push`` must be of ``version``."""
        if self.rank != 0 or self._announced is not None or self._first is None:
            return False
        fits = 0 <= step_s * 4 < self.timeout_s
        planned = self._plan is not None and self._plan.valid()
        usable = planned and self._group is not None and not self._broken and self._session_open
        if not (fits and usable and self.transport == "broadcast" and _alone()):
            return False
        names, dtypes, shapes, tagged = self._first
        wire = self._wire()
        assert isinstance(wire, Wire)
        wire.announce((names, dtypes, shapes, version if tagged is not None else None))
        self._announced = (version, wire)
        return True

    def _wire(self, version: int | None = None) -> Wire | TensorWire:
        """This push's wire: the one ``announce`` made for ``version``, else a new one."""
        assert self.client is not None and self._run is not None
        if self._announced is not None:
            announced, wire = self._announced
            if announced != version:
                raise WeightSyncError(
                    f"push of version {version} after announcing version {announced}: "
                    "push the announced version first"
                )
            self._announced = None
            return wire
        if self.transport == "tensor":
            return TensorWire(
                self.client, self._run, tp_sizes=self._tp_sizes, timeout_s=self.timeout_s,
                flush_cache=self.flush_cache,
            )  # fmt: skip
        return Wire(
            self._group, self.client, self._run, group_name=self.group_name,
            comm=self._comm(), timeout_s=self.timeout_s, flush_cache=self.flush_cache,
        )  # fmt: skip

    def _comm(self) -> torch.device:
        """Where rank 0's buckets go on the wire from."""
        if self.transport == "tensor":  # shared CPU memory, or a CUDA buffer opened by IPC
            return device.device()
        return torch.device("cpu") if self.backend == "gloo" else device.device()

    def _opening(self) -> concurrent.futures.Future[Any]:
        """The engines' weight-update session opening (SGLang loads pushed weights only
        inside one; moerl.engine answers the same), or a done future where it is kept
        open from an earlier push."""
        assert self.client is not None and self._run is not None
        if self._session_open:
            kept: concurrent.futures.Future[Any] = concurrent.futures.Future()
            kept.set_result(None)
            return kept
        return self._run(self.client.begin_weight_update())

    def _opened(self, opening: concurrent.futures.Future[Any]) -> WeightSyncError | None:
        """Wait for the session ``opening``; the error to drain the push with, or None."""
        try:
            opening.result(self.timeout_s)
        except Exception as err:  # drained like a failed send: nothing was sent
            return WeightSyncError(f"could not open the engines' weight-update session: {err}")
        self._session_open = self.keep_session
        return None

    def _end_session(self, quiet: bool = False, level: int = logging.WARNING) -> None:
        """Close the engines' weight-update session; ``quiet`` (a push already failed):
        a failure to close is logged (at ``level``), not raised over the push's own
        error."""
        assert self._run is not None
        self._session_open = False
        self._run(self._ending(quiet, level)).result()

    async def _ending(self, quiet: bool = False, level: int = logging.WARNING) -> None:
        """``_end_session`` on the engines' loop."""
        assert self.client is not None
        try:
            await asyncio.wait_for(self.client.end_weight_update(), self.timeout_s)
        except Exception as err:
            if not quiet:
                raise
            log.log(level, "could not close the engines' weight-update session: %s", err)

    async def _closing(self, version: int, sent_version: bool) -> None:
        """On the engines' loop, after every bucket loaded: the session's end (unless
        ``keep_session``), and the version alone when the last stage exported nothing."""
        assert self.client is not None
        try:
            if not self.keep_session:
                await self._ending()
            if not sent_version:  # the last stage exported nothing: bump the version alone
                await asyncio.wait_for(self.client.update_weight_version(str(version)), 60)
        except EngineError as err:  # an engine died at the end: the push is repeated
            raise WeightSyncError(f"closing the push of version {version}: {err}") from err

    def _staging_on(self, where: torch.device, hold: bool = False) -> Staging:
        key = (where, hold)
        if key not in self._staging:
            shared = self.transport == "tensor"
            self._staging[key] = Staging(self.limit_bytes, where, shared, hold=hold)
        return self._staging[key]

    def _stage_leads(self) -> list[int]:
        """Collective the first time: every pipeline stage's lead rank, in stage order."""
        if self._leads is None:
            self._leads = stage_leads()
        return sorted(self._leads.values())

    def _failed(self, wire: Any, err: Exception) -> Exception:
        """A push failed on rank 0: the wire stopped (abandoned unless broken), the
        engines' session closed; returns ``err`` to raise once the push is drained."""
        self._broken = wire.broken
        if not wire.broken:
            wire.abandon()
        self._end_session(quiet=True)
        return err

    def _sources(
        self, stream: Iterable[tuple[str, torch.Tensor]], leads: list[int], plan: bool = False
    ) -> Callable[[Borrow], list[Iterator[tuple[Bucket, bool]]]]:
        """Rank 0: each stage's buckets, in stage order, gathered (its own, from
        ``stream``, borrowing what the wire reads in place) or received (the other
        stages' leads) only as they are sent. ``plan``: ``stream`` is this model's own
        export, which a world of one replays from a ``PushPlan`` (moerl/sync/plan.py)."""

        def sources(borrow: Borrow) -> list[Iterator[tuple[Bucket, bool]]]:
            own = self._staging_on(self._comm())
            if plan and borrow is None and leads == [0] and _alone():
                return [self._planned(stream, own)]
            return [
                bucketize(stream, self.limit_bytes, self.dtype, own, borrow, self.keep)
                if lead == 0
                else receive_buckets(lead, self._staging_on(p2p_device()))
                for lead in leads
            ]  # fmt: skip

        return sources

    def _planned(
        self, stream: Iterable[tuple[str, torch.Tensor]], staging: Staging
    ) -> Iterator[tuple[Bucket, bool]]:
        """The push from the recorded plan while it holds, else exported (and recorded)."""
        if self._plan is not None and self._plan.valid():
            yield from self._plan.buckets(staging)
            return
        self._plan = None
        params = live_tensors(self.chunks)
        record = PushPlan.record(
            stream, params, self.limit_bytes, self.dtype, staging, keep=self.keep
        )
        for item in record:
            if isinstance(item, tuple):
                yield item
            else:
                self._plan = item

    def _forward(
        self,
        sources: Callable[[Borrow], list[Iterator[tuple[Bucket, bool]]]],
        version: int,
        detach: bool = False,
        start: float = 0.0,
        on_ready: Callable[[], None] | None = None,
    ) -> dict[str, int] | concurrent.futures.Future[dict[str, float]]:
        """Rank 0: every stage's buckets (``sources(wire.borrow)``, lazy iterators in
        stage order) to the engines; the last bucket of the last stage carries ``version``.
        ``detach`` (the broadcast wire): return once the last bucket is off the wire, with
        the future of ``_land`` (``start``: the push's clock, for its ``seconds``).
        ``on_ready``: as ``push`` says (not with ``detach``)."""
        assert self.client is not None and self._run is not None
        wire = self._wire(version)
        stages = sources(wire.borrow)
        sent_version = False
        opening = self._opening()  # while the first bucket is gathered
        opened = False
        error: Exception | None = None
        due = None  # detached: the buckets whose engines' answers are still due
        try:
            for n, buckets in enumerate(stages, 1):
                for bucket, last in buckets:  # gathered while the previous one is sent
                    if not opened:
                        opened, error = True, self._opened(opening)
                    if bucket.names and error is None:
                        tag = version if last and n == len(stages) else None
                        try:
                            wire.send(bucket, tag)
                        except Exception as err:
                            # an engine refused or died: the rest is still gathered and
                            # received, sent nowhere, so the other ranks finish their
                            # part of this collective push (and can push again with us)
                            error = self._failed(wire, err)
                        sent_version |= tag is not None
            if not opened:
                opened, error = True, self._opened(opening)
            if isinstance(wire, Wire) and wire.announced is not None and error is None:
                error = self._failed(wire, WeightSyncError("the push sent no bucket it announced"))
            if isinstance(wire, Wire) and error is None:
                self._first = wire.first
            early = on_ready if self.early_ready and sent_version else None
            if error is None and detach and isinstance(wire, Wire):
                due = wire.drain()
            elif error is None and isinstance(wire, Wire):
                stats = wire.finish(on_drained=early)
            elif error is None:
                stats = wire.finish()
        except Exception as err:
            if not opened:  # the session's end must not overtake its opening
                concurrent.futures.wait([opening], timeout=self.timeout_s)
            if error is None:
                self._failed(wire, err)
            raise
        if error is not None:
            raise error
        if due is not None:
            assert isinstance(wire, Wire)
            return self._run(self._land(wire, due, version, sent_version, start))
        if not (self.keep_session and sent_version):  # else nothing is left to do
            self._run(self._closing(version, sent_version)).result()
        if on_ready is not None and early is None:
            on_ready()
        return stats

    async def _land(
        self, wire: Wire, due: list[Any], version: int, sent_version: bool, start: float
    ) -> dict[str, float]:
        """On the engines' loop: the rest of a detached push (``_forward``'s end)."""
        try:
            stats = await wire.landed(due)
        except Exception:  # the push's own error goes on, the session closed as after any
            self._session_open = False
            await self._ending(quiet=True)
            raise
        await self._closing(version, sent_version)
        return {**stats, "seconds": time.perf_counter() - start}
