"""An embedded engine inside the trainer's own process (``launcher.placement=colocated``).

The same model runner, scheduler thread and FastAPI app as ``python -m moerl.engine``,
built in this process and served without a socket: the rollout side's httpx client mounts
:meth:`InProcessEngine.transport` (``httpx.ASGITransport``) for the engine's URL, so every
request is the same SGLang request the engine process would get, only handed over in
memory. No second process loads torch and transformers, no HTTP server runs, and the
weight push (``sync.transport=tensor``) hands tensor handles the engine resolves to the
trainer's own staging buffers.

The URL (``http://colocated-N.moerl.invalid``) names nothing on a network: only clients
that mount this engine's transport reach it. The handlers run on the event loop of the
caller (the rollout thread); the scheduler has its own thread, as in the process.

The object stands where an ``EngineProcess`` stands (``url``, ``wait_healthy``, ``alive``,
``exit_status``, ``restart``, ``close``, ``log_path``, ``startup_timeout_s``), so the
launcher, the supervisor and the rollout service treat both alike. A restart builds the
engine again on its initial checkpoint; the mounted transport follows it.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import httpx

_COUNTER = itertools.count()
URL_SUFFIX = ".moerl.invalid"
"""Host suffix of in-process engines' URLs (``.invalid`` is reserved: never resolvable)."""


def is_inprocess_url(url: str) -> bool:
    """Whether ``url`` names an in-process engine (no network behind it)."""
    host = httpx.URL(url).host
    return host.startswith("colocated-") and host.endswith(URL_SUFFIX)


class InProcessEngine:
    """One embedded engine built in this process from ``python -m moerl.engine`` flags."""

    def __init__(
        self,
        model_path: str | Path,
        *flags: str,
        startup_timeout_s: float = 600.0,
        log_path: Path | None = None,
        wait: bool = True,
    ) -> None:
        """Build the engine on ``model_path`` (in a background thread unless ``wait``:
        the caller builds its trainer meanwhile; ``wait_healthy`` joins it)."""
        from moerl.engine.cli import parse_args

        self.model_path = Path(model_path)
        # --num-threads, when given, is the scheduler thread's alone: the process's other
        # threads (the trainer's) keep their own
        self.args = parse_args(["--model-path", str(model_path), *flags])
        self.url = f"http://colocated-{next(_COUNTER)}{URL_SUFFIX}"
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path  # the rank's log: the engine logs through it
        self._app: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._closed = False
        self._start()
        if wait:
            self.wait_healthy()

    # -- building --------------------------------------------------------------------------

    def _start(self) -> None:
        self._ready.clear()
        self._app, self._error = None, None
        thread = threading.Thread(target=self._build, name="moerl-engine-build", daemon=True)
        thread.start()

    def _build(self) -> None:
        from moerl.engine.launch import build_state

        try:
            app = build_state(self.args)
            app.state.engine.scheduler.start()  # no ASGI lifespan: started here
            self._app = app
        except BaseException as err:  # handed to wait_healthy, which raises it
            self._error = err
        finally:
            self._ready.set()

    def wait_healthy(self) -> None:
        """Wait until the engine is built and its scheduler runs; raise why it is not."""
        if not self._ready.wait(self.startup_timeout_s):
            raise TimeoutError(
                f"the in-process engine on {self.model_path} was not built within "
                f"{self.startup_timeout_s:.0f}s (engine.startup_timeout_s)"
            )
        if self._error is not None:
            raise RuntimeError(
                f"the in-process engine on {self.model_path} failed to start: {self._error}"
            ) from self._error
        if not self.alive():
            raise RuntimeError(f"the in-process engine {self.url} {self.exit_status()}")

    # -- serving ---------------------------------------------------------------------------

    @property
    def state(self) -> Any:
        """The engine's ``EngineState`` (None until built)."""
        return None if self._app is None else self._app.state.engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """ASGI: the current app (a restart replaces it); 503 until it is built, in the
        server's own error shape."""
        app = self._app
        if app is None:
            from moerl.engine.app import error_response

            reason = "the engine is starting" if self._error is None else str(self._error)
            await error_response(reason, 503)(scope, receive, send)
            return
        await app(scope, receive, send)

    def transport(self) -> httpx.AsyncBaseTransport:
        """What an httpx client mounts for :attr:`url` to reach this engine (an error
        inside a handler is the 500 response a server sends, not an exception)."""
        return httpx.ASGITransport(app=self, raise_app_exceptions=False)

    # -- lifetime (EngineProcess's interface) ----------------------------------------------

    def alive(self) -> bool:
        """Built (or still building) and its scheduler thread runs."""
        if not self._ready.is_set():
            return not self._closed
        state = self.state
        return state is not None and state.scheduler.thread.is_alive()

    def exit_status(self) -> str:
        if self._error is not None:
            return f"failed to start: {self._error}"
        state = self.state
        if state is None:
            return "is starting"
        dead = state.scheduler.dead
        return f"stopped: {dead}" if dead else "is running"

    def restart(self, wait: bool = True) -> None:
        """Stop the scheduler and build the engine again on its initial checkpoint."""
        self._stop()
        self._closed = False
        self._start()
        if wait:
            self.wait_healthy()

    def _stop(self) -> None:
        self._ready.wait(self.startup_timeout_s)
        state = self.state
        if state is not None:
            state.scheduler.stop("the engine is shutting down")
            state.scheduler.shutdown()

    def close(self) -> None:
        """Stop the scheduler (requests in flight fail with 503); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop()

    def __enter__(self) -> InProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_mounts(engines: Any) -> dict[str, httpx.AsyncBaseTransport]:
    """httpx ``mounts`` that reach the in-process engines among ``engines``."""
    return {e.url: e.transport() for e in engines if isinstance(e, InProcessEngine)}
