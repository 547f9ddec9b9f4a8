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
