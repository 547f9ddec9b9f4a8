"""EngineSupervisor without engines of its own (SGLang servers): a server that stops
answering is reported after max_failures checks and never restarted. The restart path
of embedded engines is exercised end to end in tests/e2e/test_run.py."""

from __future__ import annotations

import asyncio

from moerl.parallel.spawn import free_port
from moerl.rollout.supervisor import EngineSupervisor


def test_unreachable_server_is_reported_not_restarted():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go() -> list[dict[str, float]]:
        sup = EngineSupervisor(None, [url], (), max_failures=2, health_timeout_s=1.0)
        seen = []
        for _ in range(3):
            await sup.check()
            seen.append(sup.metrics())
        assert not await sup.before_push()  # nothing of ours to rejoin
        if sup._http is not None:
            await sup._http.aclose()
        return seen

    seen = asyncio.run(go())
    assert [m["engine/unhealthy"] for m in seen] == [0.0, 1.0, 1.0]
    assert all(m["engine/restarts"] == 0.0 for m in seen)


def test_an_engine_that_just_answered_is_not_probed_before_a_push():
    """Before a push the supervisor skips the /health probe of an engine that answered
    the run's client within FRESH_S (the synchronous loop's /generate a moment ago); one
    that has not is probed (here nothing listens: it fails and is reported). The client's
    transport stands in for the network (there is no engine in this test)."""
    import httpx

    from moerl.rollout.client import EngineClient

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    answers = httpx.MockTransport(lambda request: httpx.Response(200, json={"tp_size": 1}))

    async def go() -> tuple[float, float]:
        client = EngineClient([url], transport=answers)
        await client.server_info()  # an answer, through the client
        sup = EngineSupervisor(client, [url], (), max_failures=1, health_timeout_s=1.0)
        await sup.before_push()
        fresh = sup.metrics()["engine/unhealthy"]
        client.answered[url] -= 60.0  # a minute ago
        await sup.before_push()
        stale = sup.metrics()["engine/unhealthy"]
        if sup._http is not None:
            await sup._http.aclose()
        await client.aclose()
        return fresh, stale

    assert asyncio.run(go()) == (0.0, 1.0)
