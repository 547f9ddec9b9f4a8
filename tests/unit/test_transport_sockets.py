"""The engine client over real sockets (moerl/rollout/transport.py's aiohttp wire).

The engines here are scripted HTTP servers on local ports (aiohttp.web): they stand in for
what a real engine cannot be made to do on demand (answer 503, stall past a timeout,
answer plain text, disappear). Each records the raw requests it got, so the tests compare
what the client put on the wire with what httpx puts there for the same call.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from moerl.rollout.client import EngineClient
from moerl.rollout.errors import EngineError

PROMPT = [1, 2, 3]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Scripted:
    """A local HTTP server answering every path with ``handler``; ``seen`` holds each
    request's method, path, headers and raw body. ``keepalive_s``: how long it keeps an
    idle connection open."""

    def __init__(self, handler: Handler, keepalive_s: float = 75.0) -> None:
        self.handler = handler
        self.keepalive_s = keepalive_s
        self.seen: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Scripted:
        async def record(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self.seen.append(
                {"method": request.method, "path": request.path, "body": body,
                 "headers": {k.lower(): v for k, v in request.headers.items()}}
            )  # fmt: skip
            return await self.handler(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.keepalive_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def ok_json(body: Any, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    return handler


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_socket_wire_sends_what_httpx_sends_and_reads_the_answer():
    """Same method, path, body bytes and content type as httpx's ``json=``; the api key
    as a bearer token; GET without a body; the answer parsed as JSON."""
    answer = {"text": "ok", "output_ids": [5, 6], "meta_info": {"id": "r"}}
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.5, "stop": ["é"]}}

    async def go():
        async with Scripted(ok_json(answer)) as engine:
            async with EngineClient([engine.url], api_key="sekrit") as client:
                got = await client._post_balanced("/generate", body)
                await client.health()
            async with httpx.AsyncClient() as plain:
                await plain.post(engine.url + "/generate", json=body)
            return engine.url, got, engine.seen

    url, got, seen = asyncio.run(go())
    ours, health, theirs = seen
    assert got == (url, answer)
    assert ours["body"] == theirs["body"] and json.loads(ours["body"]) == body
    assert ours["headers"]["content-type"] == theirs["headers"]["content-type"]
    assert ours["headers"]["authorization"] == "Bearer sekrit"
    assert (health["method"], health["path"], health["body"]) == ("GET", "/health", b"")


def test_nan_is_refused_before_anything_is_sent():
    async def go():
        async with Scripted(ok_json({})) as engine:
            async with EngineClient([engine.url]) as client:
                with pytest.raises(ValueError):
                    await client._post_balanced("/generate", {"temperature": float("nan")})
            return engine.seen

    assert asyncio.run(go()) == []


def test_a_5xx_is_retried_and_a_4xx_is_not():
    answers = iter([(503, {"error": {"message": "overloaded"}}), (200, {"text": "ok"})])

    async def flaky(request: web.Request) -> web.StreamResponse:
        status, body = next(answers)
        return web.json_response(body, status=status)

    async def refusing(request: web.Request) -> web.StreamResponse:
        return web.Response(status=400, text="unknown field `top_kk`")

    async def go():
        async with Scripted(flaky) as engine:
            async with EngineClient([engine.url], retry_backoff_s=0.0) as client:
                got = await client._post_balanced("/generate", {})
                retries = client.retries
        async with Scripted(refusing) as engine:
            async with EngineClient([engine.url], retry_backoff_s=0.0) as client:
                with pytest.raises(EngineError, match="HTTP 400: unknown field `top_kk`") as err:
                    await client._post_balanced("/generate", {})
        return got, retries, len(engine.seen), err.value.status_code

    got, retries, refused_calls, status = asyncio.run(go())
    assert got[1] == {"text": "ok"} and retries == 1
    assert refused_calls == 1 and status == 400


def test_a_dead_engine_is_named_with_the_fix_after_the_retries():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with EngineClient([url], max_retries=2, retry_backoff_s=0.0) as client:
            await client._post_balanced("/generate", {})

    with pytest.raises(EngineError) as err:
        asyncio.run(go())
    msg = str(err.value)
    assert "failed 3 times" in msg and url in msg and "engine.urls" in msg
    assert err.value.urls == [url]


def test_a_stalled_answer_times_out_and_a_control_call_is_not_sent_twice():
    """A read timeout retries a /generate (it may be repeated) but not a weight-update
    call, which the engine may have received (re-sending one would hang a collective)."""

    async def stall(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1)
        return web.json_response({})

    async def go():
        async with Scripted(stall) as engine:
            async with EngineClient(
                [engine.url], timeout_s=0.2, control_timeout_s=0.2, max_retries=1,
                retry_backoff_s=0.0,
            ) as client:  # fmt: skip
                with pytest.raises(EngineError, match="failed 2 times") as generate:
                    await client._post_balanced("/generate", {})
                calls = len(engine.seen)
                with pytest.raises(EngineError, match="was not re-sent") as control:
                    await client.end_weight_update()
                return calls, len(engine.seen) - calls, str(generate.value), str(control.value)

    generate_calls, control_calls, generate_msg, control_msg = asyncio.run(go())
    assert generate_calls == 2 and control_calls == 1
    assert "Timeout" in generate_msg and "Timeout" in control_msg


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    """The engine ends an idle connection first (its keep-alive ran out): the next call,
    a weight-update call that is never re-sent, goes out on a new connection."""

    async def go():
        async with Scripted(ok_json({"success": True}), keepalive_s=0.1) as engine:
            async with EngineClient([engine.url], max_retries=0) as client:
                await client.begin_weight_update()
                await asyncio.sleep(0.5)  # the server closes the idle connection
                await client.end_weight_update()
            return [call["path"] for call in engine.seen]

    assert asyncio.run(go()) == ["/begin_weight_update", "/end_weight_update"]


def test_a_plain_text_error_keeps_the_servers_words():
    async def broken(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="Internal Server Error: scheduler died\n")

    async def go():
        async with Scripted(broken) as engine:
            async with EngineClient([engine.url], max_retries=0) as client:
                await client._post_balanced("/generate", {})

    with pytest.raises(EngineError, match="HTTP 500 Internal Server Error: scheduler died"):
        asyncio.run(go())


def test_one_client_serves_several_event_loops_in_turn():
    """asyncio.run twice with the same client (a tool or a test may): each loop gets its
    own connections. The server runs on a loop of its own, in a thread."""
    from moerl.rollout.aio import EventLoopThread

    server = EventLoopThread("scripted-engine")
    engine = server.run(Scripted(ok_json({"text": "ok"})).__aenter__())
    try:
        client = EngineClient([engine.url])
        first = asyncio.run(client._post_balanced("/generate", {}))

        async def again_and_close():
            try:
                return await client._post_balanced("/generate", {})
            finally:
                await client.aclose()

        second = asyncio.run(again_and_close())
    finally:
        server.run(engine.__aexit__())
        server.stop()
    assert first[1] == second[1] == {"text": "ok"} and len(engine.seen) == 2
