"""Publishing the policy to the engines: one protocol, two ways.

After an optimizer step the trainer publishes its new policy version. With full
fine-tuning every weight goes by bucketed broadcast over a process group the engines
joined (:class:`FullWeights`, wrapping ``WeightSync``); with LoRA only the adapters move
and each version is a new engine adapter (:class:`Adapters`, wrapping ``AdapterSync``).
The loop sees only :class:`Publisher`:

- ``push(version, on_ready=None)`` — collective on every trainer rank; returns a
  :class:`Publication` on rank 0 (stats, and the adapter name new requests must use, if
  any); ``on_ready`` (rank 0) is called once requests sent to the engines would start on
  the new policy: where ``early_ready`` (full weights broadcast to moerl's own engines,
  which hold the requests that arrive while a push loads) as soon as the last bucket is
  off the wire, before the engines answer; otherwise once the push landed;
- ``push_sent(version)`` — as ``push``, but returns once rank 0's parameters are free
  again: a future of the ``Publication`` (rank 0) that completes when the engines have
  loaded the push, on the engines' event loop (full weights by broadcast; anything else
  lands before it returns, with a done future); ``lands_apart`` says which;
- ``pauses_generation`` — whether the rollout side brackets a push with its
  partial-rollout policy (a weight broadcast does; loading an adapter disturbs no
  request);
- ``atomic_push`` — whether the next push lands on every engine at once, between two
  of its decode steps, so no token can see half-loaded weights (rollout.in_place_pause
  'auto' then lets generation go on through it): one bucket, as the last push was, to
  moerl's own engines, which load a bucket whole on their scheduler thread;
- ``rejoin()`` — collective: engines restarted since the last push are no longer in the
  weight group, build it again (a no-op for adapters, which need no group);
- ``restore(url)`` — rank 0, on the rollout loop: bring one restarted engine to the
  current policy now; False when it must wait for the next push (full weights);
- ``announce(version, step_s)`` — rank 0, before the optimizer step whose weights
  ``version`` is: post the push's first request now, so the engines wait inside its
  broadcast when the push starts (full weights to moerl's own engines, a world of one
  rank; ``WeightSync.announce``); False where nothing was announced (adapters never);
- ``close()``;
- ``can_stage()`` — collective: whether a push can be split into ``stage()`` (collective:
  gather the weights into buffers held for it) and ``send_staged(staged, version)``
  (rank 0, from any thread, while the trainer steps on: sync.overlap); full weights with
  one pipeline stage can, adapters cannot.

Publishers return values and expose methods; the loop wires them to the rollout side,
they never call into it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass
class Publication:
    """What one push did: its version, its stats (rank 0) and, with LoRA, the engine
    adapter that serves that version."""

    version: int
    stats: dict[str, float] = field(default_factory=dict)
    adapter: str | None = None


class Publisher(Protocol):
    pauses_generation: bool

    @property
    def early_ready(self) -> bool: ...

    @property
    def lands_apart(self) -> bool: ...

    @property
    def atomic_push(self) -> bool: ...

    def push(self, version: int, on_ready: Callable[[], None] | None = None) -> Publication: ...

    def push_sent(self, version: int) -> concurrent.futures.Future[Publication]: ...

    def announce(self, version: int, step_s: float) -> bool: ...

    def rejoin(self) -> None: ...

    async def restore(self, url: str) -> bool: ...

    def close(self) -> None: ...

    def can_stage(self) -> bool: ...

    def stage(self) -> Any: ...

    def send_staged(self, staged: Any, version: int) -> Publication: ...


class FullWeights:
    """Every weight by bucketed broadcast (``moerl.sync.weights.WeightSync``)."""

    pauses_generation = True

    def __init__(self, make_sync: Any, own_engines: bool = False) -> None:
        """make_sync(): a new, unconnected WeightSync (called again on each rejoin).
        ``own_engines``: the engines are moerl's (engine.kind=embedded), which load each
        bucket between two decode steps (SGLang's need generation paused) and keep
        their weight-update session open between pushes (``WeightSync.keep_session``)."""
        self._make = make_sync
        self.own_engines = own_engines
        self._buckets: float | None = None  # the last push's, on rank 0
        self.sync = make_sync()
        self.sync.connect()

    @property
    def atomic_push(self) -> bool:
        """One bucket (as the last push had; unknown before the first: False) to
        moerl's own engines."""
        return self.own_engines and self._buckets == 1

    def _counted(self, stats: dict[str, float]) -> dict[str, float]:
        if "buckets" in stats:
            self._buckets = stats["buckets"]
        return stats

    @property
    def early_ready(self) -> bool:
        return bool(self.sync.early_ready)

    @property
    def lands_apart(self) -> bool:
        return bool(self.sync.lands_apart)

    def push(self, version: int, on_ready: Callable[[], None] | None = None) -> Publication:
        return Publication(version, self._counted(self.sync.push(version, on_ready=on_ready)))

    def push_sent(self, version: int) -> concurrent.futures.Future[Publication]:
        sent = self.sync.push_sent(version)
        out: concurrent.futures.Future[Publication] = concurrent.futures.Future()

        def landed(done: concurrent.futures.Future[dict[str, float]]) -> None:
            error = done.exception()
            if error is None:
                out.set_result(Publication(version, self._counted(done.result())))
            else:
                out.set_exception(error)

        sent.add_done_callback(landed)
        return out

    def announce(self, version: int, step_s: float) -> bool:
        return bool(self.sync.announce(version, step_s))

    def rejoin(self) -> None:
        _close_quietly(self.sync)
        self.sync = self._make()
        self.sync.connect()

    async def restore(self, url: str) -> bool:
        return False  # it joins the group again at the next push

    def close(self) -> None:
        _close_quietly(self.sync)

    def can_stage(self) -> bool:
        return self.sync.can_stage()

    def stage(self) -> Any:
        return self.sync.stage()

    def send_staged(self, staged: Any, version: int) -> Publication:
        return Publication(version, self._counted(self.sync.send_staged(staged, version)))


class Adapters:
    """Only the LoRA adapters, one engine adapter per version
    (``moerl.sync.adapters.AdapterSync``)."""

    pauses_generation = False
    atomic_push = True  # an adapter is loaded whole, in one call
    early_ready = False  # new requests name the new adapter, known once it is loaded
    lands_apart = False

    def __init__(self, sync: Any) -> None:
        self.sync = sync

    def push(self, version: int, on_ready: Callable[[], None] | None = None) -> Publication:
        stats = self.sync.push(version)
        if on_ready is not None:
            on_ready()
        return Publication(version, stats, adapter=self.sync.name(version))

    def push_sent(self, version: int) -> concurrent.futures.Future[Publication]:
        done: concurrent.futures.Future[Publication] = concurrent.futures.Future()
        done.set_result(self.push(version))  # an adapter is loaded whole, in one call
        return done

    def announce(self, version: int, step_s: float) -> bool:
        return False  # an adapter is one request, sent once it exists

    def rejoin(self) -> None:
        pass  # no group: a restarted engine got its adapter in restore()

    async def restore(self, url: str) -> bool:
        await self.sync.restore(url)
        return True

    def close(self) -> None:
        self.sync.close()

    def can_stage(self) -> bool:
        return False  # an adapter push gathers across expert-parallel ranks as it goes

    def stage(self) -> Any:
        raise NotImplementedError("adapters are pushed whole: check can_stage() first")

    def send_staged(self, staged: Any, version: int) -> Publication:
        raise NotImplementedError("adapters are pushed whole: check can_stage() first")


def build_publisher(
    cfg: Any,
    trainer: Any,
    *,
    client: Any,
    run_coro: Any,
    run_dir: Path,
    backend: str,
    transport: str = "broadcast",
    hf_dir: Path | None = None,
) -> Publisher:
    """The publisher a run's config asks for: adapters when the trainer has LoRA, full
    weights otherwise. ``client``/``run_coro``: rank 0's engine client and the loop it
    lives on (None elsewhere); ``transport``: full weights' (sync_transport); ``hf_dir``:
    the run's initial checkpoint, whose model class says what a cast push leaves in
    float32 (``sync.dtype``; a router's weights). Full weights
    connect here (collective)."""
    if trainer.lora is not None:
        from moerl.sync.adapters import AdapterSync

        return Adapters(
            AdapterSync(
                trainer.adapters,
                trainer.peft_config(),
                client=client,
                run_coro=run_coro,
                transport=cfg.sync.adapter_transport,
                directory=cfg.sync.adapter_dir or run_dir / "adapters",
            )  # fmt: skip
        )
    from moerl.sync.weights import WeightSync, fp32_modules

    keep = fp32_modules(hf_dir) if cfg.sync.dtype and hf_dir is not None else []
    own = cfg.engine.kind == "embedded"

    def make_sync() -> WeightSync:
        return WeightSync(
            trainer.chunks, cfg.model, client=client, bucket_mb=cfg.sync.bucket_mb,
            dtype=cfg.sync.dtype, backend=backend, master_address=cfg.sync.master_address,
            master_port=cfg.sync.master_port, run_coro=run_coro,
            flush_cache=cfg.rollout.partial_rollout != "in_place", transport=transport,
            keep_dtype=keep, keep_session=own,
        )  # fmt: skip

    return FullWeights(make_sync, own_engines=own)


def _close_quietly(sync: Any) -> None:
    """Close a weight group that a restarted engine may no longer be part of."""
    try:
        sync.close()
    except Exception as err:  # the restarted engine never had the group
        log.info("closing the old weight group: %s", err)
