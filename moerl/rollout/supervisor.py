"""Engine supervision on the rollout loop: restart embedded engines that die or stop
answering, report SGLang servers that do.

The orchestrator already survives a lost engine: the client retries a request on
another engine and a failed group is generated again. The supervisor brings the
capacity back. An embedded engine whose process exited, or whose ``/health`` failed
``max_failures`` checks in a row, is killed and started again on the same port (so its
URL stays valid) with its initial weights; it is paused until the trainer has rebuilt
the weight-sync group and pushed the current weights (``needs_reconnect`` /
``reconnected``), so it never serves tokens of an old policy. The trainer pushes at the
next step boundary, or at once when it is waiting for a batch (``wants_weights``): the
batch may need the paused engine, the only one there is. A
SGLang server is not ours to restart: it is reported (log and metrics) and left to the
client's retries and cooldown.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

log = logging.getLogger(__name__)


FRESH_S = 1.0
"""Before a push, an engine that answered within this many seconds is not probed."""
EXIT_GRACE_S = 5.0
"""After a failed push, how long an embedded engine that does not answer has to be seen
exiting: a killed process resets its connections a moment before it can be reaped."""


class EngineSupervisor:
    def __init__(
        self,
        client: Any,
        urls: Sequence[str],
        procs: Sequence[Any] = (),
        *,
        interval_s: float = 2.0,
        max_failures: int = 3,
        max_restarts: int = 5,
        health_timeout_s: float = 10.0,
        on_restart: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.client = client
        self.urls = [u.rstrip("/") for u in urls]
        self.procs = {p.url.rstrip("/"): p for p in procs}
        self.interval_s, self.max_failures = interval_s, max_failures
        self.max_restarts, self.health_timeout_s = max_restarts, health_timeout_s
        self.failures = dict.fromkeys(self.urls, 0)
        self.restarts = 0
        # brings a restarted engine to the current policy itself (True: LoRA adapters) or
        # leaves it for the next push (False: full weights need the group rebuilt)
        self.on_restart = on_restart
        self.unhealthy: set[str] = set()  # SGLang servers currently failing
        self._pending: set[str] = set()  # restarted, waiting for weights
        self._wants = asyncio.Event()  # set while _pending is not empty
        self._restarting: set[str] = set()
        self._stopped = asyncio.Event()
        self._lock = asyncio.Lock()
        self._http: httpx.AsyncClient | None = None

    @property
    def needs_reconnect(self) -> bool:
        return bool(self._pending)

    @property
    def restarting(self) -> bool:
        """Whether an engine is being restarted now."""
        return bool(self._restarting)

    async def wait_restarts(self, timeout_s: float = 600.0) -> bool:
        """Wait for engines being restarted to come up; True when the trainer must
        rebuild the weight-sync group (an engine was restarted since the last time)."""
        deadline = time.monotonic() + timeout_s
        while self._restarting and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._restarting:
            raise RuntimeError(f"engines {sorted(self._restarting)} did not come back in time")
        return self.needs_reconnect

    async def wants_weights(self) -> None:
        """Return once a restarted engine waits for the current weights (at once if one
        does now)."""
        await self._wants.wait()

    async def reconnected(self) -> None:
        """The restarted engines have the current weights: let them generate."""
        urls, self._pending = sorted(self._pending), set()
        self._wants.clear()
        if urls:
            await self.client.continue_generation(urls=urls)

    def metrics(self) -> dict[str, float]:
        return {
            "engine/restarts": float(self.restarts),
            "engine/unhealthy": float(len(self.unhealthy)),
        }

    async def _healthy(self, http: httpx.AsyncClient, url: str) -> bool:
        try:
            return (await http.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _restart(self, http: httpx.AsyncClient, url: str, why: str) -> None:
        proc = self.procs[url]
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"engine {url} {why} and {self.restarts} restarts were already spent "
                f"(engine log: {proc.log_path}); fix the engine or raise the restart budget"
            )
        log.warning("engine %s %s; restarting it (log: %s)", url, why, proc.log_path)
        print(f"moerl: engine {url} {why}; restarting it", flush=True)
        self._restarting.add(url)
        try:
            proc.restart(wait=False)
            deadline = time.monotonic() + proc.startup_timeout_s
            while not await self._healthy(http, url):
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine {url} did not come back after a restart; log: {proc.log_path}"
                    )
                await asyncio.sleep(0.2)
            self.restarts += 1
            ready = await self.on_restart(url) if self.on_restart is not None else False
            if not ready:  # hold it until it has the current weights (the trainer's next push)
                await self.client.pause_generation("abort", urls=[url])
                self._pending.add(url)
                self._wants.set()
            self.failures[url] = 0
        finally:
            self._restarting.discard(url)

    async def check(self, fresh_s: float = 0.0, exit_grace_s: float = 0.0) -> None:
        """One pass over the engines (restarting embedded ones that need it); one that
        answered the client within ``fresh_s`` counts as healthy without a probe; an
        embedded one that fails its probe and exits within ``exit_grace_s`` is restarted
        at once."""
        async with self._lock:
            if self._http is None:
                from moerl.engine.inprocess import engine_mounts

                self._http = httpx.AsyncClient(
                    timeout=self.health_timeout_s, mounts=engine_mounts(self.procs.values())
                )
            http = self._http
            for url in self.urls:
                proc = self.procs.get(url)
                if proc is not None and not proc.alive():
                    await self._restart(http, url, f"exited with {proc.exit_status()}")
                    continue
                if url in self._pending:
                    continue
                answered = getattr(self.client, "answered", {}).get(url, -math.inf)
                if time.monotonic() - answered < fresh_s or await self._healthy(http, url):
                    self.failures[url] = 0
                    self.unhealthy.discard(url)
                    continue
                if proc is not None and await _exits(proc, exit_grace_s):
                    await self._restart(http, url, f"exited with {proc.exit_status()}")
                    continue
                self.failures[url] += 1
                if self.failures[url] < self.max_failures:
                    continue
                if proc is not None:
                    await self._restart(http, url, f"failed {self.failures[url]} health checks")
                elif url not in self.unhealthy:
                    self.unhealthy.add(url)
                    log.warning("engine %s is not healthy; requests go elsewhere", url)
                    print(f"moerl: engine {url} is not healthy (not restarted: not ours)")

    async def before_push(self) -> bool:
        """Check every engine now (a weight push must not meet a dead peer), wait for
        restarts; True when the trainer must rebuild the weight-sync group. An engine
        that answered this run's client within ``FRESH_S`` (the synchronous loop's last
        /generate, a moment ago) is not probed again; an embedded one is still checked
        for having exited."""
        await self.check(fresh_s=FRESH_S)
        return await self.wait_restarts()

    async def after_failed_push(self) -> bool:
        """After a push that failed: every engine probed now, however recently it answered
        (the push just met one that did not), an embedded one that no longer answers given
        ``EXIT_GRACE_S`` to be seen exiting and restarted; restarts waited for. True when
        the trainer must rebuild the weight-sync group."""
        await self.check(exit_grace_s=EXIT_GRACE_S)
        return await self.wait_restarts()

    async def run(self) -> None:
        try:
            while not self._stopped.is_set():
                await self.check()
                try:
                    await asyncio.wait_for(self._stopped.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            if self._http is not None:
                await self._http.aclose()
                self._http = None

    def stop(self) -> None:
        self._stopped.set()


async def _exits(proc: Any, within_s: float) -> bool:
    """Whether ``proc`` is seen exited within ``within_s`` (polled)."""
    deadline = time.monotonic() + within_s
    while proc.alive():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True
