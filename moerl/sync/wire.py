"""Trainer rank 0's side of the weight broadcast: buckets on the wire, two requests deep.

Each bucket is one ``flattened_bucket`` broadcast over the custom group, announced by
one ``/update_weights_from_distributed`` per engine (SGLang's protocol: one request, one
broadcast). :meth:`Wire.send` puts a bucket on the wire as soon as the previous one is off
it, without waiting for the engines to load that one: the engines receive bucket k+1
while they copy bucket k into the model, and the caller gathers bucket k+2 meanwhile.

Requests reach an engine in broadcast order: a broadcast finishes at the root only once
every engine has entered it (gloo and NCCL both meet the receivers), so the request
for bucket k+1, sent after bucket k's broadcast finished, arrives while the engine is
inside bucket k's receive, and the engine receives in arrival order
(``moerl.engine.weights.routes``). At most two requests are in flight: bucket k+1 goes out only
once the engines answered bucket k-1, so an engine needs two receive buffers.

Waits are on futures (the broadcast's and the HTTP call's, whichever ends first), never
polls: an engine that refuses a bucket before receiving it surfaces at once.
:meth:`Wire.finish` is :meth:`Wire.drain` (the last bucket off the wire: rank 0's
buffers are free) then the engines' answers; a detached push (``WeightSync.push_sent``)
awaits those on the event loop instead (:meth:`Wire.landed`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from moerl.rollout.client import EngineClient
from moerl.sync.stream import Bucket

RunCoro = Callable[[Coroutine[Any, Any, Any]], "concurrent.futures.Future[Any]"]

Layout = tuple[list[str], list[str], list[list[int]], int | None]
"""A bucket as its request states it: names, dtypes, shapes, and the push's version where
the bucket carries it (the last one)."""


# seconds a broadcast may take to complete here after an engine already refused its bucket
REFUSAL_GRACE_S = 5.0


class WeightSyncError(RuntimeError):
    """A weight sync could not start or an engine refused a bucket; says which and why."""


@dataclass
class _InFlight:
    what: str  # the bucket, in words for errors
    bucket: Bucket
    wire: concurrent.futures.Future[None]  # the broadcast, done at the root
    http: concurrent.futures.Future[Any]  # the engines' answer


def _future_of(work: Any) -> concurrent.futures.Future[None]:
    """A ``concurrent.futures.Future`` settled when a c10d ``work`` finishes."""
    out: concurrent.futures.Future[None] = concurrent.futures.Future()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            done.wait()
        except Exception as err:  # an engine left the group
            out.set_exception(err)
        else:
            out.set_result(None)

    work.get_future().add_done_callback(settle)
    return out


class Wire:
    """Broadcasts buckets to the engines of ``group``; one per push.

    ``send`` each bucket in order, then ``finish``; after an error the group is out of
    step (``broken``) or still usable (the engines refused a bucket after receiving it).
    """

    def __init__(
        self,
        group: Any,
        client: EngineClient,
        run_coro: RunCoro,
        *,
        group_name: str,
        comm: torch.device,
        timeout_s: float,
        flush_cache: bool,
    ) -> None:
        self.group, self.client, self._run = group, client, run_coro
        self.group_name, self.comm, self.timeout_s = group_name, comm, timeout_s
        self.flush_cache = flush_cache
        self.broken = False
        self.stats = {"bytes": 0, "buckets": 0, "tensors": 0}
        self.borrow = None  # every bucket is broadcast from its gathered bytes
        self._sent = 0
        self._sending: _InFlight | None = None  # on the wire
        self._landed: _InFlight | None = None  # received, the engines' answer pending
        # ``announce``'s request for the first bucket, posted before the bucket exists
        self._announced: tuple[Layout, concurrent.futures.Future[Any]] | None = None
        self.first: Layout | None = None  # the first bucket sent: what the next push announces

    def announce(self, layout: Layout) -> None:
        """Post the first bucket's request now, before its bytes exist: the engines enter
        its broadcast and wait there (admitting no new request), so ``send`` then finds
        them receiving. ``layout`` (names, dtypes, shapes, and the push's version where the
        bucket is its last) must be the first bucket's; ``send`` refuses another."""
        assert self._sent == 0 and self._announced is None, "announce before the first send"
        names, dtypes, shapes, version = layout
        self._announced = (layout, self._post(names, dtypes, shapes, version))

    @property
    def announced(self) -> Layout | None:
        """The layout ``announce`` posted, until the first ``send`` takes it."""
        return None if self._announced is None else self._announced[0]

    def _post(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None
    ) -> concurrent.futures.Future[Any]:
        return self._run(
            self.client.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=self.group_name,
                flush_cache=version is not None and self.flush_cache,
                weight_version=None if version is None else str(version),
                load_format="flattened_bucket",
            )
        )

    def send(self, bucket: Bucket, version: int | None) -> None:
        """Broadcast ``bucket`` once the previous one is off the wire; ``version`` tags
        the last bucket of a push. The bucket's bytes are free again at the next
        ``send`` (or ``finish``)."""
        if self._sending is not None:
            self._off_wire(self._sending)
            landed, self._landed, self._sending = self._landed, self._sending, None
            if landed is not None:
                self._answered(landed)
        layout = (bucket.names, bucket.dtypes, bucket.shapes, version)
        announced, self._announced = self._announced, None
        if announced is not None and announced[0] != layout:
            # the engines wait in a broadcast of another size: nothing can be sent to them
            self.broken = True
            raise WeightSyncError(
                f"the push's first bucket ({len(bucket.names)} tensors from {bucket.names[0]}, "
                f"version {version}) is not the one announced ({len(announced[0][0])} tensors "
                f"from {announced[0][0][0]}, version {announced[0][3]}): the model's export "
                "changed since the last push; close() and connect() again"
            )
        flat = bucket.flattened().to(self.comm)
        self._sent += 1
        if self._sent == 1:  # a copy: the next push compares against it
            self.first = (list(bucket.names), list(bucket.dtypes),
                          [list(shape) for shape in bucket.shapes], version)  # fmt: skip
        what = f"bucket {self._sent} ({len(bucket.names)} tensors from {bucket.names[0]})"
        http = announced[1] if announced is not None else self._post(*layout)
        self._sending = _InFlight(what, bucket, _future_of(self.group.broadcast(flat, 0)), http)

    def finish(self, on_drained: Callable[[], None] | None = None) -> dict[str, int]:
        """Wait for every bucket sent to be loaded; returns the totals. ``on_drained``
        is called once the last bucket is off the wire (every engine is receiving it),
        before the engines' answers are awaited."""
        due = self.drain()
        if on_drained is not None:
            on_drained()
        for flight in due:
            self._answered(flight)
        return self.stats

    def drain(self) -> list[_InFlight]:
        """``finish``'s first half: wait for the last bucket to leave the wire (then every
        byte sent is off rank 0's buffers); returns the buckets whose engines' answers
        are still due, for ``landed``."""
        if self._sending is not None:
            self._off_wire(self._sending)
        due = [f for f in (self._landed, self._sending) if f is not None]
        self._sending = self._landed = None
        return due

    async def landed(self, due: list[_InFlight]) -> dict[str, int]:
        """``finish``'s second half, on the event loop the engines' calls run on: wait
        for them to load ``due`` (``drain``'s); returns the totals."""
        for flight in due:
            try:
                await asyncio.wait_for(asyncio.wrap_future(flight.http), self.timeout_s)
            except Exception as err:
                raise WeightSyncError(f"engines rejected {flight.what}: {err}") from err
            self._count(flight)
        return self.stats

    def abandon(self) -> None:
        """After an error: let what is still in flight end, so the group stays in step."""
        if self._announced is not None:  # its engines wait for bytes no one will send
            self.broken, self._announced = True, None
        for left in (self._sending, self._landed):
            if left is not None:
                concurrent.futures.wait([left.wire, left.http], timeout=self.timeout_s)
        self._sending = self._landed = None

    def _off_wire(self, flight: _InFlight) -> None:
        """Wait for ``flight``'s broadcast; raise at once if the engines refused it first."""
        deadline = time.monotonic() + self.timeout_s
        while not flight.wire.done():
            if flight.http.done() and flight.http.exception() is not None:
                # an engine that received the bucket and then refused it can answer before
                # this side marks the broadcast done (seen on busy cores): give the wire a
                # grace period before calling the group out of step
                grace = min(REFUSAL_GRACE_S, max(0.0, deadline - time.monotonic()))
                concurrent.futures.wait([flight.wire], timeout=grace)
                if flight.wire.done():
                    break
                # the engine answered without receiving: the group is out of step for good
                self.broken = True
                raise WeightSyncError(
                    f"engines refused {flight.what} before receiving it: "
                    f"{flight.http.exception()}; close() and connect() again"
                ) from flight.http.exception()
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = True
                raise WeightSyncError(f"broadcast of {flight.what} took over {self.timeout_s:.0f}s")
            # an answer can come before the broadcast is marked done here: then wait on
            waits = [flight.wire] if flight.http.done() else [flight.wire, flight.http]
            concurrent.futures.wait(
                waits, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )
        error = flight.wire.exception()
        if error is not None:  # an engine left the group: its answer says why
            self.broken = True
            try:
                reason = f"engine said: {flight.http.result(timeout=10)}"
            except Exception as answer:
                reason = f"engine said: {answer}"
            raise WeightSyncError(
                f"broadcast of {flight.what} failed ({error}); {reason}; close() and connect() again"
            ) from error

    def _answered(self, flight: _InFlight) -> None:
        """Wait for the engines to load ``flight`` (already off the wire)."""
        try:
            flight.http.result(timeout=self.timeout_s)
        except Exception as err:
            raise WeightSyncError(f"engines rejected {flight.what}: {err}") from err
        self._count(flight)

    def _count(self, flight: _InFlight) -> None:
        self.stats["bytes"] += flight.bucket.nbytes
        self.stats["buckets"] += 1
        self.stats["tensors"] += len(flight.bucket.names)
