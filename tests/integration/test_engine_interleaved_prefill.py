"""A prefill longer than one ``--chunked-prefill-size`` forward runs one chunk per
scheduler step with the running requests decoding in between (SGLang's interleaving), and
gives the same tokens as when it runs alone; aborted or retracted between two chunks, it
stops cleanly (and, retracted, starts again and finishes with the same tokens).

The order of forwards is read from a spy around the engine's own ``ModelRunner.extend``
and ``decode`` (the real ones run); the abort and the retract are queued as scheduler
controls from inside that spy, so they land exactly between two chunks."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from moerl.engine.inprocess import InProcessEngine, engine_mounts

CHUNK = 16
LONG = [3 + (7 * i) % 90 for i in range(100)]  # 7 chunks of at most 16 tokens
SHORT = [5, 17, 3, 99, 42, 8]  # not a multiple of CHUNK's remainder: told apart


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):  # type: ignore[no-untyped-def]
    eng = InProcessEngine(
        tiny_checkpoints["deepseek_moe"], "--chunked-prefill-size", str(CHUNK),
        "--disable-radix-cache",
    )  # fmt: skip
    yield eng
    eng.close()


class Spy:
    """Records ('E', tokens per row) for each extend and ('D', rows) for each decode."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.runner, self.scheduler = engine.state.runner, engine.state.scheduler
        self.events: list[tuple[str, Any]] = []
        self.after_first_long_chunk: list[Any] = []  # controls to queue then
        self.fail_long_chunk: int | None = None  # this chunk of the long prompt raises
        self.decoding = threading.Event()  # set at the first decode step
        self._extend, self._decode = self.runner.extend, self.runner.decode

        def extend(pool, slots, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
            if rows and len(rows[0]) == CHUNK and self.fail_long_chunk is not None:
                self.fail_long_chunk -= 1
                if self.fail_long_chunk == 0:
                    raise RuntimeError("a fault planted in the third chunk")
            out = self._extend(pool, slots, rows, *args, **kwargs)
            self.events.append(("E", [len(r) for r in rows]))
            if rows and len(rows[0]) == CHUNK and self.after_first_long_chunk:
                for fn in self.after_first_long_chunk:
                    self.scheduler.controls.put((fn, lambda *_: None))
                self.after_first_long_chunk = []
            return out

        def decode(pool, slots, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.events.append(("D", len(slots)))
            self.decoding.set()
            return self._decode(pool, slots, *args, **kwargs)

        self.runner.extend, self.runner.decode = extend, decode

    def close(self) -> None:
        self.runner.extend, self.runner.decode = self._extend, self._decode

    def long_chunks(self) -> list[int]:
        """Indices of the events that prefilled the long prompt's chunks."""
        return [
            i for i, (kind, rows) in enumerate(self.events)
            if kind == "E" and rows and rows[0] in (CHUNK, len(LONG) % CHUNK)
        ]  # fmt: skip


def _body(ids: list[int], new: int, rid: str) -> dict:
    return {
        "input_ids": ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
    }


async def _with_a_runner(engine: InProcessEngine, spy: Spy, long_rid: str) -> tuple[dict, dict]:
    """A short request decoding 60 tokens; once it decodes, the long prompt is sent.
    Returns both answers."""
    async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=120) as client:
        runner = asyncio.create_task(
            client.post(f"{engine.url}/generate", json=_body(SHORT, 60, f"runner-{long_rid}"))
        )
        await asyncio.to_thread(spy.decoding.wait, 60)
        long = await client.post(f"{engine.url}/generate", json=_body(LONG, 4, long_rid))
        return long.json(), (await runner).json()


async def _alone(engine: InProcessEngine, ids: list[int], new: int) -> dict:
    async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=120) as client:
        return (await client.post(f"{engine.url}/generate", json=_body(ids, new, "alone"))).json()


def test_running_requests_decode_between_the_chunks_of_a_long_prefill(engine):
    alone = asyncio.run(_alone(engine, LONG, 4))
    spy = Spy(engine)
    try:
        long, runner = asyncio.run(_with_a_runner(engine, spy, "long"))
    finally:
        spy.close()
    assert long["output_ids"] == alone["output_ids"]  # interleaving changes no token
    assert runner["meta_info"]["completion_tokens"] == 60
    chunks = spy.long_chunks()
    assert len(chunks) == 7
    for a, b in zip(chunks, chunks[1:]):  # a decode step of the running request between
        assert any(kind == "D" for kind, _ in spy.events[a + 1 : b]), spy.events[a : b + 1]


def test_a_request_aborted_between_two_chunks_stops_there(engine):
    scheduler = engine.state.scheduler
    spy = Spy(engine)
    spy.after_first_long_chunk = [lambda: scheduler.abort(rid="cut")]
    try:
        long, runner = asyncio.run(_with_a_runner(engine, spy, "cut"))
    finally:
        spy.close()
    assert long["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(spy.long_chunks()) == 1 and long["output_ids"] == []
    assert runner["meta_info"]["completion_tokens"] == 60  # the other request went on
    assert scheduler.prefilling == [] and asyncio.run(_alone(engine, SHORT, 2))["output_ids"]


def test_a_retract_between_two_chunks_prefills_again_with_the_same_tokens(engine):
    scheduler = engine.state.scheduler
    alone = asyncio.run(_alone(engine, LONG, 4))
    spy = Spy(engine)
    spy.after_first_long_chunk = [lambda: scheduler.pause("retract"), scheduler.resume]
    try:
        long, runner = asyncio.run(_with_a_runner(engine, spy, "again"))
    finally:
        spy.close()
    assert long["output_ids"] == alone["output_ids"]
    first = spy.long_chunks()[0]
    again = sum(sum(rows) for kind, rows in spy.events[first + 1 :] if kind == "E")
    assert again >= len(LONG)  # after one chunk, the whole prompt again (and the runner's)
    assert runner["meta_info"]["completion_tokens"] == 60  # retracted and resumed too


def test_a_chunk_that_raises_fails_its_request_and_everyone_else_is_answered(engine):
    """No thread ends silently: the long prompt's third chunk raises inside the scheduler
    thread; its client gets the error within the client's 30 s, the running request
    finishes, and the engine answers a new request."""
    scheduler = engine.state.scheduler
    spy = Spy(engine)
    spy.fail_long_chunk = 3
    try:

        async def run() -> tuple[httpx.Response, dict, dict]:
            async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=30) as client:
                url = f"{engine.url}/generate"
                runner = asyncio.create_task(client.post(url, json=_body(SHORT, 60, "r-fault")))
                await asyncio.to_thread(spy.decoding.wait, 30)
                long = await client.post(url, json=_body(LONG, 4, "fault"))
                after = await client.post(url, json=_body(SHORT, 2, "after"))
                return long, (await runner).json(), after.json()

        long, runner, after = asyncio.run(run())
    finally:
        spy.close()
    assert long.status_code == 500 and "a fault planted in the third chunk" in long.text
    assert runner["meta_info"]["completion_tokens"] == 60
    assert len(after["output_ids"]) == 2 and scheduler.prefilling == []
    assert scheduler.dead is None


class Clock:
    """The scheduler's clock, advanced only by the spied forwards: a chunk of the long
    prompt costs ``chunk`` units, a decode step one (no wall time read)."""

    def __init__(self, chunk: float) -> None:
        self.now, self.chunk = 0.0, chunk

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("share, between", [(0.5, 4), (0.75, 12), (0.0, 1)])
def test_after_each_chunk_the_running_requests_decode_for_their_share(engine, share, between):
    """--decode-share: after a chunk that took c, decode steps fill c * share / (1 - share)
    before the next chunk (a chunk of 4 units against decode steps of 1: 4 steps at
    0.5, 12 at 0.75); 0 is one decode step per chunk. The long prompt's tokens are those
    it gets alone."""
    scheduler = engine.state.scheduler
    alone = asyncio.run(_alone(engine, LONG, 4))
    spy = Spy(engine)
    clock = Clock(chunk=4.0)
    extend, decode = spy.runner.extend, spy.runner.decode

    def timed_extend(pool, slots, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        clock.now += clock.chunk if rows and len(rows[0]) in (CHUNK, len(LONG) % CHUNK) else 0
        return extend(pool, slots, rows, *args, **kwargs)

    def timed_decode(pool, slots, *args, **kwargs):  # type: ignore[no-untyped-def]
        clock.now += 1.0
        return decode(pool, slots, *args, **kwargs)

    spy.runner.extend, spy.runner.decode = timed_extend, timed_decode
    share_before = scheduler.decode_share
    scheduler.clock, scheduler.decode_share = clock, share
    try:

        async def run() -> tuple[dict, dict]:
            async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=120) as client:
                url = f"{engine.url}/generate"
                runner = asyncio.create_task(client.post(url, json=_body(SHORT, 110, "share")))
                await asyncio.to_thread(spy.decoding.wait, 60)
                long = await client.post(url, json=_body(LONG, 4, f"long-{share}"))
                return long.json(), (await runner).json()

        long, runner = asyncio.run(run())
    finally:
        spy.close()
        scheduler.clock, scheduler.decode_share = time.perf_counter, share_before
    assert long["output_ids"] == alone["output_ids"]
    assert runner["meta_info"]["completion_tokens"] == 110  # still running at the last chunk
    chunks = spy.long_chunks()
    assert len(chunks) == 7
    for a, b in zip(chunks, chunks[1:]):
        decodes = [e for e in spy.events[a + 1 : b] if e[0] == "D"]
        assert len(decodes) == between, spy.events[a : b + 1]


def test_decode_share_outside_zero_to_one_is_a_usage_error():
    from moerl.engine.cli import parse_args
    from moerl.engine.core.scheduler import Scheduler

    assert parse_args(["--model-path", "x"]).decode_share == 0.6
    for bad in ("1", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "x", "--decode-share", bad])
    with pytest.raises(ValueError, match=r"--decode-share 1.0 must be in \[0, 1\)"):
        Scheduler(None, decode_share=1.0)  # type: ignore[arg-type]


def test_shared_prompt_min_tokens_is_checked_where_it_is_read():
    """--shared-prompt-min-tokens: >= 1, or -1 for copies (None in the scheduler)."""
    from moerl.engine.cli import parse_args
    from moerl.engine.core.scheduler import Scheduler

    assert parse_args(["--model-path", "x"]).shared_prompt_min_tokens == 256
    assert (
        parse_args(
            ["--model-path", "x", "--shared-prompt-min-tokens", "-1"]
        ).shared_prompt_min_tokens
        == -1
    )
    for bad in ("0", "-2", "1.5"):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "x", "--shared-prompt-min-tokens", bad])
    with pytest.raises(ValueError, match=r"--shared-prompt-min-tokens 0 must be >= 1"):
        Scheduler(None, shared_prompt_min_tokens=0)  # type: ignore[arg-type]
