"""The in-process engine of ``launcher.placement=colocated`` (moerl/engine/inprocess.py):
the same SGLang requests as the engine process, handed over through an httpx ASGI mount
instead of a socket; weights by tensor handle; a failed build, a stopped scheduler and a
restart reported as the process's are."""

from __future__ import annotations

import asyncio
import base64
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from moerl.engine.inprocess import InProcessEngine, engine_mounts, is_inprocess_url
from moerl.engine.weights.tensor_payload import serialize_named_tensors
from moerl.rollout.client import EngineClient
from moerl.rollout.errors import EngineError
from moerl.sync.tensor_wire import share_cpu_tensors

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def colocated(tiny_checkpoints) -> InProcessEngine:
    engine = InProcessEngine(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
    yield engine
    engine.close()


async def _greedy(client: EngineClient) -> list[dict]:
    return list(
        await asyncio.gather(
            *(client.generate(p, GREEDY, return_routed_experts=True) for p in PROMPTS)
        )
    )


def _routes(out: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)


def test_answers_as_the_engine_process(colocated, ds_engine):
    """Greedy tokens, logprobs and routes through the mount equal the engine process's on
    the same checkpoint (an independent process, reached over HTTP)."""

    async def both() -> tuple[list[dict], list[dict]]:
        mounts = engine_mounts([colocated])
        async with EngineClient([colocated.url], mounts=mounts) as here:
            async with EngineClient([ds_engine.url]) as there:
                return await _greedy(here), await _greedy(there)

    mine, theirs = asyncio.run(both())
    assert is_inprocess_url(colocated.url) and not is_inprocess_url(ds_engine.url)
    for a, b in zip(mine, theirs, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [x for x, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [x for x, _, _ in b["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)
        assert np.array_equal(np.sort(_routes(a)), np.sort(_routes(b)))


def test_bad_body_is_a_400_and_the_engine_keeps_serving(colocated):
    """An invalid request is answered (400 naming the field) as over HTTP, not raised
    into the caller, and the next request is served."""

    async def go() -> dict:
        async with EngineClient([colocated.url], mounts=engine_mounts([colocated])) as c:
            with pytest.raises(EngineError, match="temperature") as err:
                await c.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": -1.0})
            assert err.value.status_code == 400
            return await c.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0})

    assert len(asyncio.run(go())["output_ids"]) == 2


def test_tensor_push_lands_in_the_engine_without_a_copy_on_the_wire(colocated):
    """/update_weights_from_tensor through the mount: the engine's parameter takes the
    pushed values and the version; the session rule holds as for the process."""
    runner = colocated.state.runner
    name = "model.layers.0.self_attn.o_proj.weight"
    before = dict(runner.model.named_parameters())[name].detach().clone()
    share_cpu_tensors()  # as the tensor wire does: handles by file name
    new = (torch.randn_like(before) * 0.02).share_memory_()

    async def go() -> None:
        async with EngineClient([colocated.url], mounts=engine_mounts([colocated])) as c:
            push = partial(
                c.update_weights_from_tensor,
                partial(serialize_named_tensors, [(name, new)]),
                weight_version="7",
            )
            with pytest.raises(EngineError, match="begin_weight_update"):
                await push()  # outside a session: refused, as SGLang refuses it
            await c.begin_weight_update()
            await push()
            await c.end_weight_update()
            info = await c.server_info()
            assert info[colocated.url]["weight_version"] == "7"

    try:
        asyncio.run(go())
        assert torch.equal(dict(runner.model.named_parameters())[name].detach(), new)
    finally:
        runner.load_bucket([name], [before.shape], [before])


def test_a_failed_build_names_the_checkpoint(tmp_path: Path):
    engine = InProcessEngine(tmp_path / "missing", wait=False)
    with pytest.raises(RuntimeError, match="missing.*failed to start"):
        engine.wait_healthy()
    assert not engine.alive()
    assert "failed to start" in engine.exit_status()
    engine.close()


def test_stop_is_reported_and_requests_fail_fast_then_restart_serves(tiny_checkpoints):
    """A stopped scheduler: /health 503 with the reason and /generate refused at once
    (no hang); restart builds the engine again behind the same mount."""
    engine = InProcessEngine(tiny_checkpoints["qwen3_moe"])
    mounts = engine_mounts([engine])  # mounted once, as the rollout client does

    async def health_and_generate() -> tuple[int, str]:
        async with EngineClient([engine.url], mounts=mounts, max_retries=0) as c:
            status = (await c._http.get(f"{engine.url}/health")).status_code
            try:
                await asyncio.wait_for(c.generate([1, 2], GREEDY), 30)
                return status, "served"
            except EngineError as err:
                return status, str(err)

    try:
        engine.state.scheduler.shutdown()
        assert not engine.alive() and "stopped" in engine.exit_status()
        status, answer = asyncio.run(health_and_generate())
        assert status == 503 and "HTTP 503 the engine is shutting down" in answer
        engine.restart()
        assert engine.alive()
        assert asyncio.run(health_and_generate()) == (200, "served")
    finally:
        engine.close()
    assert not engine.alive()


_THREADS_PROBE = """
import sys, threading, torch
from moerl.engine.inprocess import InProcessEngine

torch.set_num_threads(2)  # the trainer's, in the process
engine = InProcessEngine(sys.argv[1], "--num-threads", "1")
box = {}
done = threading.Event()
engine.state.scheduler.control(
    lambda: torch.get_num_threads(), lambda result, err: (box.update(n=result), done.set())
)
done.wait(60)
later = []
thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
thread.start()
thread.join()
engine.close()
print("THREADS", box["n"], torch.get_num_threads(), later[0])
"""


def test_the_colocated_schedulers_thread_count_is_its_own(tiny_checkpoints):
    """--num-threads of an engine built inside another process sets the scheduler
    thread's torch threads alone: the process's main thread, and threads started later,
    keep the process's count (a second OpenMP team of the engine's would make libgomp's
    threads sleep at once, slowing every op of the trainer's; moerl/config/threads.py)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _THREADS_PROBE, str(tiny_checkpoints["deepseek_moe"])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    scheduler, main, later = out.stdout.strip().splitlines()[-1].split()[1:]
    assert (int(scheduler), int(main), int(later)) == (1, 2, 2)
