"""Transport for the engine client: engine selection, retries, broadcast, error shapes.

- One request (`_post_balanced`, used for /generate) goes to the engine with the fewest
  requests outstanding from this client (ties rotate). Connection errors, timeouts and HTTP
  5xx are retried, on an engine not yet tried when there is one, else on the same engines
  after an exponential backoff; an engine that failed is skipped for `cooldown_s` while others
  are up. HTTP 4xx is never retried.
- Control calls (`_broadcast`) go to every engine (or `urls=`) concurrently and return
  `{url: parsed body}`. They are retried only when the request never reached the engine
  (connection refused, connect timeout), except read-only calls (idempotent=True), which
  also retry timeouts and 5xx: re-sending a weight broadcast or group join that did arrive
  would hang the collective.
- Bodies: JSON, `{}` when empty, `{"message": text}` for plain text. HTTP status >= 400 or
  `"success": false` raises EngineError with the server's message, whichever of SGLang's
  shapes it uses (`message`, `error_message`, `error` as string or {"message"}, `detail`).
- The wire: aiohttp for engines behind a socket (a round of four /generate requests took
  0.37 ms of the client's CPU against 2.2 ms through httpx, whose layers the rollout
  thread paid for on every request, sharing one interpreter lock with the trainer);
  httpx where the engine has no socket (``mounts``: in-process engines, an ASGI mount)
  or the caller replaces the network (``transport``, for tests). Both send the same
  bytes (JSON as httpx encodes it) and fail the same ways.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson

from moerl.engine import API_KEY_ENV
from moerl.rollout.errors import EngineError

# The request may have been processed: retry only calls that are safe to repeat.
_RETRYABLE: tuple[type[BaseException], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    aiohttp.ClientConnectionError,  # the connection broke (or timed out) mid-request
    aiohttp.ClientPayloadError,
    asyncio.TimeoutError,  # aiohttp's read timeout
)
# The request never reached the engine: always safe to repeat.
_UNDELIVERED: tuple[type[BaseException], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    aiohttp.ClientConnectorError,  # refused, unreachable, unresolvable
    aiohttp.ConnectionTimeoutError,
)

DEAD_ENGINE_FIX = (
    "check that the engine is running and reachable (`curl URL/health`), then restart it "
    "or remove its URL from engine.urls"
)

_T = TypeVar("_T", bound="EngineTransport")
_JSON = {"Content-Type": "application/json"}
KEEPALIVE_S = 4.0
"""How long the client keeps an idle connection to an engine (below the servers' 5 s)."""
_CLIENTS = object()
"""``EngineTransport._send``'s default timeout: the client's own."""


def normalize_urls(urls: str | Sequence[str]) -> list[str]:
    """Base URLs without a trailing slash; each needs an http(s) scheme."""
    items = [urls] if isinstance(urls, str) else list(urls)
    if not items:
        raise ValueError("EngineClient needs at least one engine URL")
    out = []
    for url in items:
        url = str(url).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {url!r} needs a scheme, e.g. 'http://{url}'")
        if url not in out:
            out.append(url)
    return out


@dataclass(frozen=True)
class Reply:
    """An engine's answer, from either wire."""

    status_code: int
    content: bytes


def parse_body(resp: Reply) -> Any:
    """JSON when the body is JSON, {} when empty, {"message": text} otherwise."""
    if not resp.content:
        return {}
    try:  # orjson first: a group's logprobs and routes parse several times faster
        return orjson.loads(resp.content)
    except ValueError:
        pass
    text = resp.content.decode("utf-8", errors="replace")
    try:  # what orjson refuses and the json module reads (NaN, huge integers)
        return json.loads(text)
    except ValueError:
        return {"message": text.strip()}


def encode_json(body: Any) -> bytes:
    """``body`` as httpx encodes ``json=`` (compact, UTF-8; NaN and inf refused)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def error_message(body: Any) -> str:
    """The server's own words from any of SGLang's error shapes."""
    if isinstance(body, Mapping):
        for key in ("message", "error_message", "error", "detail"):
            value = body.get(key)
            if isinstance(value, Mapping) and "message" in value:
                value = value["message"]
            if value:
                return str(value)
    return str(body)[:500]


class EngineTransport:
    """HTTP plumbing shared by every engine call; EngineClient adds the protocol."""

    def __init__(
        self,
        urls: str | Sequence[str],
        api_key: str | None = None,
        timeout_s: float | None = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        *,
        control_timeout_s: float | None = 1800.0,
        connect_timeout_s: float = 10.0,
        cooldown_s: float = 5.0,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        mounts: Mapping[str, httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        """timeout_s bounds one /generate attempt (requests wait while an engine is paused
        for a weight update, so keep it generous); control_timeout_s bounds control calls
        (weight broadcasts of large models take minutes). transport replaces the network,
        for tests; mounts reach some URLs without one (in-process engines,
        moerl.engine.inprocess)."""
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        self.urls = normalize_urls(urls)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.control_timeout_s = control_timeout_s
        self.cooldown_s = cooldown_s
        self._outstanding = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._rotation = 0
        self._rid_url: dict[str, str] = {}
        self.answered = dict.fromkeys(self.urls, -math.inf)
        """time.monotonic() of each engine's last answer below HTTP 500 to this client."""
        self.retries = 0
        """/generate attempts re-sent after a failed one, over this client's life (metrics)."""
        if api_key is None:  # as the engine: the key may come from the environment
            api_key = os.environ.get(API_KEY_ENV) or None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = headers
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._max_connections = max_connections
        # httpx serves every URL when the caller replaced the network, else the mounted ones
        self._httpx_only = transport is not None
        self._mounted = set(normalize_urls(list(mounts))) if mounts else set()
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
            mounts=dict(mounts) if mounts else None,
            # Engine traffic stays inside the cluster; never route it through an env proxy.
            trust_env=False,
        )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None and not session.closed:
                await session.close()
        finally:
            await self._http.aclose()

    def _aiohttp(self) -> aiohttp.ClientSession:
        """The aiohttp session of the running event loop (made on first use in it)."""
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and self._session_loop is not loop:
            # made in an earlier event loop (asyncio.run again): its connections are that
            # loop's; left to it, closed or not
            session.detach()
            session = None
        if session is None or session.closed:
            self._session_loop = loop
            session = self._session = aiohttp.ClientSession(
                # idle connections go before the servers' own keep-alive (5 s in uvicorn,
                # SGLang and this engine) ends them under a request
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEPALIVE_S
                ),
                headers=self._headers,
                timeout=self._timeout(self._timeout_s),
                # engine traffic stays inside the cluster: never through an env proxy
                trust_env=False,
            )
        return session

    def _timeout(self, read_s: float | None) -> aiohttp.ClientTimeout:
        """httpx's timeouts: each wait for the server, not the whole answer."""
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect_timeout_s, sock_read=read_s
        )

    async def _send(
        self, method: str, url: str, path: str, body: Any, timeout_s: Any = _CLIENTS
    ) -> Reply:
        """One HTTP request; ``timeout_s`` replaces the client's read timeout (None: none)."""
        if self._httpx_only or url in self._mounted:
            kwargs: dict[str, Any] = {} if timeout_s is _CLIENTS else {"timeout": timeout_s}
            answer = await self._http.request(method, url + path, json=body, **kwargs)
            return Reply(answer.status_code, answer.content)
        kwargs = {} if timeout_s is _CLIENTS else {"timeout": self._timeout(timeout_s)}
        if body is not None:  # as httpx sends json=None: no body
            kwargs["data"] = encode_json(body)
            kwargs["headers"] = _JSON
        async with self._aiohttp().request(method, url + path, **kwargs) as reply:
            return Reply(reply.status, await reply.read())

    async def __aenter__(self: _T) -> _T:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def outstanding(self) -> dict[str, int]:
        """Requests in flight per engine URL (this client's view)."""
        return dict(self._outstanding)

    def _pick(self, exclude: Sequence[str]) -> str:
        """Fewest outstanding among engines not yet tried and not cooling down."""
        now = time.monotonic()
        fresh = [u for u in self.urls if u not in exclude] or self.urls
        up = [u for u in fresh if self._down_until[u] <= now] or fresh
        n = len(self.urls)
        start = self._rotation
        self._rotation = (self._rotation + 1) % n
        return min(up, key=lambda u: (self._outstanding[u], (self.urls.index(u) - start) % n))

    async def _post_balanced(self, path: str, body: Any, rid: str | None = None) -> tuple[str, Any]:
        tried: list[str] = []
        failures: list[str] = []
        for _ in range(self.max_retries + 1):
            url = self._pick(exclude=tried)
            if tried:
                self.retries += 1
            repeats = tried.count(url)
            if repeats:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (repeats - 1))
            tried.append(url)
            self._outstanding[url] += 1
            if rid is not None:
                self._rid_url[rid] = url
            try:
                resp = await self._send("POST", url, path, body)
            except _RETRYABLE as e:
                self._down_until[url] = time.monotonic() + self.cooldown_s
                failures.append(f"{url}: {type(e).__name__} {e}".rstrip())
                continue
            finally:
                self._outstanding[url] -= 1
                if rid is not None and self._rid_url.get(rid) == url:
                    del self._rid_url[rid]
            if resp.status_code >= 500:
                self._down_until[url] = time.monotonic() + self.cooldown_s
                failures.append(f"{url}: HTTP {resp.status_code} {error_message(parse_body(resp))}")
                continue
            self.answered[url] = time.monotonic()
            return url, _checked("POST", url, path, resp)
        engines = ", ".join(dict.fromkeys(tried))
        raise EngineError(
            f"POST {path} failed {len(tried)} times on {engines}; last: {failures[-1]}. "
            f"{DEAD_ENGINE_FIX}",
            urls=list(dict.fromkeys(tried)),
        )

    # ---- control plumbing ----------------------------------------------------------------

    def _targets(self, urls: str | Sequence[str] | None) -> list[str]:
        return list(self.urls) if urls is None else normalize_urls(urls)

    async def _broadcast(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        urls: Sequence[str] | None = None,
        idempotent: bool = True,
        bodies: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Send to every target concurrently; `bodies` gives per-engine bodies by URL."""
        targets = self._targets(urls)
        results = await asyncio.gather(
            *(
                self._control_one(
                    u, method, path, body if bodies is None else bodies[u], idempotent
                )
                for u in targets
            ),
            return_exceptions=True,
        )
        failed = [(u, r) for u, r in zip(targets, results) if isinstance(r, BaseException)]
        for _, err in failed:
            if not isinstance(err, EngineError):
                raise err
        if len(failed) == 1:
            raise failed[0][1]
        if failed:
            raise EngineError(
                f"{method} {path} failed on {len(failed)} of {len(targets)} engines:\n"
                + "\n".join(f"  {err}" for _, err in failed),
                urls=[u for u, _ in failed],
                status_code=getattr(failed[0][1], "status_code", None),
            )
        return dict(zip(targets, results))

    async def _control_one(
        self,
        url: str,
        method: str,
        path: str,
        body: Any,
        idempotent: bool,
        attempts: int | None = None,
    ) -> Any:
        attempts = self.max_retries + 1 if attempts is None else attempts
        last = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._send(method, url, path, body, self.control_timeout_s)
            except _UNDELIVERED as e:
                last = f"{type(e).__name__} {e}".rstrip()
                continue
            except _RETRYABLE as e:
                if not idempotent:
                    raise EngineError(
                        f"{method} {url}{path}: {type(e).__name__} {e}; the engine may have "
                        f"received it, so it was not re-sent. {DEAD_ENGINE_FIX}",
                        urls=[url],
                    ) from e
                last = f"{type(e).__name__} {e}".rstrip()
                continue
            if resp.status_code >= 500 and idempotent and attempt + 1 < attempts:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code < 500 and url in self.answered:
                self.answered[url] = time.monotonic()
            return _checked(method, url, path, resp)
        raise EngineError(
            f"{method} {url}{path} failed {attempts} times; last: {last}. {DEAD_ENGINE_FIX}",
            urls=[url],
        )


def _checked(method: str, url: str, path: str, resp: Reply) -> Any:
    body = parse_body(resp)
    if resp.status_code >= 400:
        hint = " (check the client's api_key)" if resp.status_code in (401, 403) else ""
        raise EngineError(
            f"{method} {url}{path} -> HTTP {resp.status_code}: {error_message(body)}{hint}",
            urls=[url],
            status_code=resp.status_code,
        )
    if isinstance(body, Mapping) and body.get("success") is False:
        raise EngineError(
            f"{method} {url}{path} refused: {error_message(body)}",
            urls=[url],
            status_code=resp.status_code,
        )
    return body
