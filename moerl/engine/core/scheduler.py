"""Continuous batching: requests join and leave the running batch at every step.

One background thread owns the model. Each iteration it first runs control actions
(weight updates, pause/continue, aborts) — so a weight swap happens between decode
steps and running requests keep going on the new weights — then prefills newly
arrived requests together in one forward (``--max-prefill-tokens`` tokens at most per
step, a longer input in forwards of ``--chunked-prefill-size`` tokens: one such forward
per iteration at most, so the running requests keep decoding while a long prompt
prefills, as SGLang interleaves them; after a chunk, they decode for at least
``--decode-share`` of the time, so a chunk that costs many decode steps does not starve
them), then decodes one token for every running request in a single batched forward.
Each request's keys and values live in its slot of one ``KVPool`` that decode reads in
place. Before prefilling, a request reuses the KV and routes of the longest prefix the
``PrefixCache`` holds, so only the rest is prefilled; requests admitted together with
the same input (the n samples of a GRPO group) run it once, with the cache or without
it, and a prompt is cached as soon as it is prefilled, so samples admitted later reuse
it too. A prefill runs in a ``KVPool`` of its own; each request then gets a running slot
holding a copy of its prompt, or, for a group on a prompt of at least
``--shared-prompt-min-tokens``, one that reads the prompt's single copy (``_place``), so
a group's KV grows with n × response; a cached prefix that long is read where the cache
keeps it (``_reuse``). HTTP handlers talk to the thread through thread-safe queues and
get results back on their asyncio loop.

An idle engine that gets a request waits a moment before admitting it
(``--admission-wait-ms``, at most, until no request arrived for
``--admission-quiet-ms``): requests a client sent together (a synchronous step's GRPO
groups, one /generate each) then prefill in one forward and decode in step, where
admitting the first alone would prefill the others in a second forward and run every
decode step after it for fewer rows than the batch holds. The wait also ends once as many
requests wait as the engine's last busy spell admitted: the next step of a synchronous
loop sends as many as the last. A busy engine admits at once.
The copied prompts go to their slots in one indexed copy per pool tensor, and the
requests a decode step finishes are all answered before their KV goes to the prefix
cache and their slots are freed: together, in one hand-over to each event loop that
waits for some of them (``LoopCallback``).

The thread survives its requests: an exception while prefilling, decoding or sampling
fails only the requests that step touched (a batched forward that raises is retried one
request at a time to find them), and logits that are not finite fail their request. Each
failed request finishes with an abort reason carrying the message and an HTTP status.
If the thread ends anyway (a BaseException, or shutdown), ``dead`` says why, every queued
and running request is failed, and ``submit`` and ``control`` refuse at once.
"""

# T tokens, L layers, K top-k

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moerl.engine.core.kv_pool import KVPool, Prefix
from moerl.engine.core.model_runner import ModelRunner
from moerl.engine.core.prefix_cache import PrefixCache, Sequence
from moerl.engine.core.sampling import (
    Matcher,
    Sampled,
    Sampler,
    SamplingParams,
    prompt_logprobs,
    sample_batch,
)

log = logging.getLogger(__name__)

QUEUE_FULL = "The request queue is full."  # SGLang's words, with HTTP 503


class LoopCallback:
    """A request's ``on_done`` that runs ``fn(request)`` on ``loop`` (the server's asyncio
    event loop), called on the scheduler thread. Each hand-over to a loop writes its
    wake-up pipe, and the woken loop takes the interpreter lock from the scheduler thread
    for its turn: a GRPO group's 8 samples ending in one decode step made 8 such turns in
    the middle of the step (61 µs each in a profile of the tiny model's batch). So a
    step hands every callback it has for one loop over at once (``Scheduler._settle``);
    called alone, it hands over its own."""

    __slots__ = ("fn", "loop")

    def __init__(self, loop: Any, fn: Callable[[Request], None]) -> None:
        self.loop, self.fn = loop, fn

    def __call__(self, request: Request) -> None:
        self.loop.call_soon_threadsafe(self.fn, request)


def _run_callbacks(calls: list[tuple[Callable[[Request], None], Request]]) -> None:
    """On the loop: the callbacks a step handed over together; one that raises is logged
    and the others still run."""
    for fn, request in calls:
        try:
            fn(request)
        except Exception:
            log.exception("on_done of request %s failed", request.rid)


def settles(loop: Any, future: Any) -> Callable[[Any, BaseException | None], None]:
    """A ``Scheduler.control`` ``done(result, error)`` that settles ``future`` (an asyncio
    future of ``loop``) on ``loop``, unless it is done already (cancelled)."""

    def settle(result: Any, err: BaseException | None) -> None:
        if future.done():
            return
        if err is not None:
            future.set_exception(err)
        else:
            future.set_result(result)

    return lambda result, err: loop.call_soon_threadsafe(settle, result, err)


class Unavailable(RuntimeError):
    """The scheduler takes no more work: its queue is full or its thread ended (HTTP 503)."""


@dataclass
class Request:
    """One sequence being generated (an ``n > 1`` request becomes n of these)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = 0  # with return_logprob: input-token logprobs from here
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False  # the server's: token texts beside logprobs
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str = "selected"
    lora: str | None = None  # adapter name (the request's lora_path)
    matcher: Matcher | None = None  # the grammar's state (moerl.engine.core.grammar)
    on_token: Callable[[Request], None] | None = None  # streaming callback (scheduler thread)
    on_done: Callable[[Request], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    ids_logprobs: list[list[float]] = field(default_factory=list)  # token_ids_logprob
    # prompt positions logprob_start_len.. (the first is None: nothing precedes it)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ids_logprobs: list[list[float] | None] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    sampling_logprobs: list[Any] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    # [T, L, K] chunks, one per forward (the prefix cache's rows first), from token 0
    routes: list[np.ndarray] = field(default_factory=list)
    slot: int | None = None  # its slot in the scheduler's KV pool, while it holds KV
    cached_tokens: int = 0  # leading input tokens whose KV and routes the prefix cache gave
    cache_epoch: tuple[int, int] | None = None  # the prefix cache's, at admission
    sampler: Sampler | None = None  # made at admission
    stop_tail: int = 0  # output tokens decoded to look for stop strings (0: all)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """Owns the ``ModelRunner``; see the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running_requests: int = 64,
        max_queued_requests: int | None = None,
        max_prefill_per_step: int = 64,
        max_prefill_tokens: int = 16384,
        chunked_prefill_size: int = 8192,
        eos_token_ids: list[int] | None = None,
        tokenizer: Any = None,
        weight_version: str = "0",
        enable_routed_experts: bool = False,
        prefix_cache: PrefixCache | None = None,
        stop_regex_timeout_s: float = 0.05,
        admission_wait_s: float = 0.0,
        admission_quiet_s: float = 0.0,
        decode_share: float = 0.6,
        threads: int | None = None,
        shared_prompt_min_tokens: int | None = 256,
    ) -> None:
        self.runner = runner
        if shared_prompt_min_tokens is not None and shared_prompt_min_tokens < 1:
            raise ValueError(
                f"--shared-prompt-min-tokens {shared_prompt_min_tokens} must be >= 1 (-1: off)"
            )
        # the samples of a group admitted together read one copy of a prompt this long
        # (None: each holds its own)
        self.share_min_tokens = shared_prompt_min_tokens
        if threads is not None and threads < 1:
            raise ValueError(f"--num-threads {threads} must be >= 1")
        # torch CPU threads of the scheduler thread's own ops (its forwards and sampling),
        # set in that thread alone: an engine inside a trainer's process leaves the
        # trainer's threads as they are (None: the process's)
        self.threads = threads
        if not (isinstance(decode_share, (int, float)) and 0 <= decode_share < 1):
            raise ValueError(f"--decode-share {decode_share!r} must be in [0, 1)")
        # while a chunked prefill is pending, the running requests' decode steps get at
        # least this share of the thread's time: a chunk of c seconds is followed by
        # c * share / (1 - share) seconds of steps without one (0: one decode step per chunk)
        self.decode_share = float(decode_share)
        self._next_chunk_at = 0.0  # on ``clock``: the pending prefill's next chunk not before
        self.clock: Callable[[], float] = time.perf_counter  # tests inject their own
        if admission_wait_s < 0 or admission_quiet_s < 0:
            raise ValueError(
                f"--admission-wait-ms {1e3 * admission_wait_s:g} and --admission-quiet-ms "
                f"{1e3 * admission_quiet_s:g} must be >= 0"
            )
        # an idle engine's wait for the requests sent with the first (0: admit at once)
        self.admission_wait_s = admission_wait_s
        self.admission_quiet_s = min(admission_quiet_s, admission_wait_s)
        self.admission_waits = 0  # times an idle engine waited for more arrivals
        # the wait also ends once as many requests wait as the engine's last busy spell
        # admitted (a synchronous loop sends the same number every step): ``_begin_spell``
        self.expected_arrivals = 0
        self.admitted_by_count = 0  # waits that ended so, before the quiet window
        self._arrived = 0  # requests ever submitted (under _gate)
        self._spell_start = 0  # of those, the ones that came before this busy spell
        # while an idle engine waits for arrivals, a submission wakes it only once this many
        # wait (``_await_arrivals``; 0 otherwise: every one wakes it); each leaves its time
        self._wake_at = 0
        self._last_arrival = 0.0
        if stop_regex_timeout_s <= 0:
            raise ValueError(f"--stop-regex-timeout-ms {1e3 * stop_regex_timeout_s:g} must be > 0")
        # one stop_regex search on the scheduler thread may take this long; past it, the
        # request ends with a 400 and every other request goes on
        self.stop_regex_timeout_s = stop_regex_timeout_s
        self.prefix_cache = prefix_cache  # None: --disable-radix-cache
        if max_running_requests < 1:
            raise ValueError(f"--max-running-requests {max_running_requests} must be >= 1")
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests {max_queued_requests} must be >= 1")
        self.max_running = max_running_requests
        self.max_queued = max_queued_requests
        self.max_prefill = max_prefill_per_step
        if max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens {max_prefill_tokens} must be >= 1")
        self.max_prefill_tokens = max_prefill_tokens
        # SGLang's -1: no chunking
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.pool = runner.new_pool(max_running_requests)
        self.eos = set(eos_token_ids or [])
        self.tokenizer = tokenizer  # decodes output tails for stop strings and stop_regex
        self.weight_version = weight_version
        self.enable_routed_experts = enable_routed_experts
        self.waiting: queue.Queue[Request] = queue.Queue()
        # a submission larger than the running batch (n=1024, a batch of 400 prompts)
        # queues its first --max-running-requests; the rest joins ``waiting`` a batch at a
        # time as it drains (``_feed``), so a request sent after it waits behind one batch
        # of it, not all of it (SGLang queues it behind all; moerl's own)
        self.backlog: collections.deque[Request] = collections.deque()
        self._backlog_lock = threading.Lock()
        self.retracted: list[Request] = []
        self.running: list[Request] = []
        # a prefill longer than one --chunked-prefill-size forward: one chunk per step,
        # decode steps of the running requests between (SGLang's interleaving)
        self._prefilling: Generator[None, None, None] | None = None
        self.prefilling: list[Request] = []
        self.controls: queue.Queue[
            tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]
        ] = queue.Queue()
        self.paused = False
        # weight updates received or loading (``hold_admission``): no request starts
        # while any is, as in SGLang, where a generation request waits for the update's
        # lock; the requests already running go on (each update loads between two steps)
        self.holds = 0
        # /release_memory_occupation's tags in force; requests wait while any is
        self.released: set[str] = set()
        self._weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.dead: str | None = None  # why the thread ended; set once, under _gate
        self._gate = threading.Lock()  # orders submit/control against the thread's end
        self.failed_requests = 0  # requests failed by an error in a step
        # during a decode step's sampling: requests it finished, cached and freed after
        self._settling: list[Request] | None = None
        self.wake = threading.Event()
        self.stop_event = threading.Event()
        self._stop_reason = "the engine is shutting down"
        self.thread = threading.Thread(target=self._loop, name="moerl-scheduler", daemon=True)
        self.steps = 0
        # turns of the loop, stepping or not: a step count that did not move over some
        # turns shows nothing ran (paused), with no wall-clock wait
        self.loops = 0
        self.last_step_s = 0.0
        # (wall-clock start, seconds, running requests after the step) of recent steps
        self.step_times: list[tuple[float, float, int]] = []

    # -- public (any thread) -----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, reason: str = "the engine is shutting down") -> None:
        """Ask the thread to end after its current step (any thread; does not wait)."""
        self._stop_reason = reason
        self.stop_event.set()
        self.wake.set()

    def shutdown(self) -> None:
        self.stop()
        self.thread.join(timeout=30)

    def submit(self, *requests: Request, bounded: bool = True) -> None:
        """Queue requests, all or none: Unavailable if the thread ended or (``bounded``)
        they do not fit in --max-queued-requests."""
        with self._gate:
            if self.dead is not None:
                raise Unavailable(self.dead)
            if (
                bounded
                and self.max_queued is not None
                and self.queued() + len(requests) > self.max_queued
            ):
                raise Unavailable(QUEUE_FULL)
            for request in requests[: self.max_running]:
                self.waiting.put(request)
            if len(requests) > self.max_running:
                with self._backlog_lock:
                    self.backlog.extend(requests[self.max_running :])
            self._arrived += len(requests)
            self._last_arrival = time.perf_counter()
        if self.queued() >= self._wake_at:
            self.wake.set()

    def queued(self) -> int:
        """Requests waiting to start (``waiting`` and the backlog of large submissions)."""
        return self.waiting.qsize() + len(self.backlog)

    def queued_requests(self) -> list[Request]:
        """A snapshot of the requests waiting to start (any thread)."""
        with self.waiting.mutex:
            waiting = list(self.waiting.queue)
        with self._backlog_lock:
            return waiting + list(self.backlog)

    def _feed(self) -> None:
        """Top ``waiting`` up from the backlog to one running batch (scheduler thread)."""
        room = self.max_running - self.waiting.qsize()
        if room > 0 and self.backlog:
            with self._backlog_lock:
                for _ in range(min(room, len(self.backlog))):
                    self.waiting.put(self.backlog.popleft())

    def control(
        self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Run ``fn`` on the scheduler thread between steps; ``done(result, error)`` after
        (at once with Unavailable if the thread ended)."""
        with self._gate:
            if self.dead is None:
                self.controls.put((fn, done))
                self.wake.set()
                return
        done(None, Unavailable(self.dead))

    def hold_admission(self) -> Callable[[], None]:
        """Until the returned release is called (once; later calls do nothing), no
        waiting request starts: a weight update takes this when its request arrives and
        releases it once its weights are loaded or refused, so a request that arrives
        after the update's request starts on its weights (SGLang's generation requests
        wait on the same update's lock). Requests already running go on. Any thread."""
        with self._gate:
            self.holds += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._gate:
                if released:
                    return
                released = True
                self.holds -= 1
            self.wake.set()

        return release

    def cancel(self, requests: list[Request], message: str) -> None:
        """Abort these requests (a client that went away), from any thread."""
        self.control(lambda: self.abort(requests=requests, message=message), lambda *_: None)

    def uses_adapter(self, name: str) -> int:
        """Requests (running or retracted) generating with adapter ``name``."""
        return sum(1 for r in self.running + self.retracted + self.prefilling if r.lora == name)

    def load(self) -> int:
        return len(self.running) + self.queued() + len(self.retracted) + len(self.prefilling)

    # -- control actions (scheduler thread) ------------------------------------------------
    def finish(self, request: Request, reason: dict[str, Any]) -> None:
        if request.done:
            return
        request.finish_reason = reason
        failed = bool(reason.get("status_code"))
        if self._settling is not None and not failed:
            # a decode step's: answered with the step's others, then its KV cached and
            # freed (its slot is not reused before)
            self._settling.append(request)
            return
        if not failed:  # finished or aborted
            self._keep(request)
        self.pool.free(request, wipe=failed)  # its KV now, not when the server drops it
        self._answer(request)

    def _answer(self, request: Request) -> None:
        if request.on_done is not None:
            try:
                request.on_done(request)
            except Exception:  # the server's side is gone (loop closed); nothing waits
                log.exception("on_done of request %s failed", request.rid)

    def _answer_all(self, requests: list[Request]) -> None:
        """Answer ``requests`` (a step's): each loop's ``LoopCallback``s in one hand-over,
        any other callback on its own, in order."""
        loops: dict[int, tuple[Any, list[tuple[Callable[[Request], None], Request]]]] = {}
        for request in requests:
            done = request.on_done
            if isinstance(done, LoopCallback):
                loops.setdefault(id(done.loop), (done.loop, []))[1].append((done.fn, request))
            else:
                self._answer(request)
        for loop, calls in loops.values():
            try:
                loop.call_soon_threadsafe(_run_callbacks, calls)
            except Exception:  # the server's side is gone (loop closed); nothing waits
                log.exception("answering %d requests failed", len(calls))

    def _settle(self) -> None:
        """The requests a decode step (or a prefill's first tokens) finished: out of the
        running batch, answered, then their KV to the prefix cache, then freed."""
        settling, self._settling = self._settling or [], None
        if settling:  # an answered request no longer runs (``running_requests`` says so)
            self.running = [r for r in self.running if not r.done]
        self._answer_all(settling)
        try:
            self._keep(*settling)
        except Exception:  # a cache that cannot take them: the requests are answered
            log.exception("caching %d finished requests failed", len(settling))
        # the highest slot first: a freed slot takes the last used one's KV, and a step
        # that finishes the whole batch (a group's samples end together) then moves none
        # (each free in step order moved a finishing request's KV into a finishing slot)
        for request in sorted(settling, key=_slot_of, reverse=True):
            self.pool.free(request)

    def fail(self, request: Request, message: str, status_code: int = 500) -> None:
        """Finish ``request`` with an error (an abort with an HTTP status, as SGLang's)."""
        if request.done:
            return
        self.failed_requests += 1
        self.finish(request, _abort(message, status_code))

    def abort(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        message: str = "aborted",
        requests: list[Request] | None = None,
    ) -> int:
        """Finish matching requests (running, retracted or waiting) with an abort reason:
        all, those whose rid starts with ``rid`` (as SGLang matches), or ``requests``."""

        def match(req: Request) -> bool:
            if requests is not None:
                return any(req is r for r in requests)
            return abort_all or req.rid.startswith(str(rid))

        count = 0
        keep_running = []
        for req in self.running + self.retracted + self.prefilling:
            if match(req):
                self.finish(req, _abort(message))
                count += 1
            elif req in self.running:
                keep_running.append(req)
        self.retracted = [r for r in self.retracted if not r.done]
        self.running = keep_running
        self.prefilling = [r for r in self.prefilling if not r.done]  # the rest go on
        pending = []
        while True:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            if match(req):
                self.finish(req, _abort(message))
                count += 1
            else:
                pending.append(req)
        for req in pending:
            self.waiting.put(req)
        with self._backlog_lock:
            kept: collections.deque[Request] = collections.deque()
            for req in self.backlog:
                if match(req):
                    self.finish(req, _abort(message))
                    count += 1
                else:
                    kept.append(req)
            self.backlog = kept
        return count

    def pause(self, mode: str) -> None:
        """abort: finish every running request; retract: drop their KV caches and requeue
        them (prompt + output so far is re-prefilled on continue); in_place: keep all state."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode={mode!r}: choose 'abort', 'retract' or 'in_place'")
        self.paused = True
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation")
        elif mode == "retract":
            for req in self.running:
                self.pool.free(req)
            self.retracted.extend(self.running)
            self.running = []
            self._drop_prefill(requeue=True)

    def resume(self) -> None:
        self.paused = False

    def release_memory(self, tags: list[str]) -> None:
        """SGLang's /release_memory_occupation, on this thread: 'kv_cache' drops the KV pool
        and the prefix cache, 'weights' the model's parameters (their values are gone: push
        weights after resuming them), 'cuda_graph' is accepted (there are none). Only when
        idle; requests that arrive meanwhile wait until every tag is resumed."""
        if self.running or self.retracted or self.prefilling:
            busy = len(self.running) + len(self.retracted) + len(self.prefilling)
            raise ValueError(
                "release_memory_occupation should be called only when server is idle "
                f"({busy} requests running): "
                "pause_generation first"
            )
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.flush_cache()
            self.pool = self.runner.new_pool(0)  # empty: it grows again from the first forward
        if "weights" in tags and "weights" not in self.released:
            self._weight_shapes = self.runner.release_weights()
        self.released.update(tags)

    def resume_memory(self, tags: list[str]) -> None:
        """SGLang's /resume_memory_occupation: the released memory back (weights as zeros)."""
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(f"tags {missing} are not released (released: {sorted(self.released)})")
        if "kv_cache" in tags:
            self.pool = self.runner.new_pool(self.max_running)
        if "weights" in tags:
            self.runner.resume_weights(self._weight_shapes)
            self._weight_shapes = {}
        self.released.difference_update(tags)
        self.wake.set()

    def flush_cache(self) -> None:
        """Forget every cached prefix (new weights, or /flush_cache)."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def flush_adapter(self, name: str) -> None:
        """Forget the prefixes cached under adapter ``name`` (loaded anew or unloaded)."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush_adapter(name)

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        reason = None
        try:
            if self.threads is not None:  # inside: a failure here ends the thread as any
                own_torch_threads(self.threads)
            while not self.stop_event.is_set():
                self.loops += 1
                self._run_controls()
                if (
                    self.paused
                    or self.released
                    or (
                        not self.running
                        and (
                            self.holds
                            or (self.waiting.empty() and not self.backlog and not self.retracted)
                        )
                        and self._prefilling is None
                    )
                ):
                    self.wake.wait(timeout=0.05)
                    self.wake.clear()
                    continue
                try:
                    self._step()
                except Exception as err:  # outside any one request: fail those in the step
                    log.exception("scheduler step failed")
                    self._drop_prefill(requeue=False)
                    for req in self.running + self.retracted + self.prefilling:
                        self.fail(req, f"scheduler step failed: {_words(err)}")
                    self.running, self.retracted, self.prefilling = [], [], []
        except BaseException as err:  # the thread ends here, logged; _close says why
            reason = f"the scheduler thread died: {_words(err)}"
            log.critical(reason, exc_info=True)
        finally:
            self._close(reason or self._stop_reason)

    def _step(self) -> None:
        start, wall_start = time.perf_counter(), time.time()
        if self._prefilling is None:
            if not self.running and not self.retracted and not self.holds:
                self._begin_spell()
                self._await_arrivals()
            if not self.holds:  # else a weight update is loading: admit after it
                self._admit()
        elif not self.running or self.clock() >= self._next_chunk_at:
            self._advance_prefill()
        if self.running:
            self._decode()
        self.last_step_s = time.perf_counter() - start
        self.steps += 1
        self.step_times.append((wall_start, self.last_step_s, len(self.running)))
        del self.step_times[:-256]

    def _close(self, reason: str) -> None:
        """The thread ends: refuse new work, fail all queued, running and control work."""
        with self._gate:
            self.dead = reason
        self._drop_prefill(requeue=False)
        for req in self.running + self.retracted + self.prefilling:
            self.fail(req, reason, 503)
        self.running, self.retracted, self.prefilling = [], [], []
        while True:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            self.fail(req, reason, 503)
        with self._backlog_lock:
            left, self.backlog = list(self.backlog), collections.deque()
        for req in left:
            self.fail(req, reason, 503)
        while True:
            try:
                _, done = self.controls.get_nowait()
            except queue.Empty:
                break
            done(None, Unavailable(reason))

    def _run_controls(self) -> None:
        while True:
            try:
                fn, done = self.controls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except Exception as err:  # reported to the caller, never kills the loop
                done(None, err)
            else:
                done(result, None)

    def _begin_spell(self) -> None:
        """An idle engine with requests waiting starts a busy spell: the requests admitted
        since the last one began (those that arrived before the ones now waiting) become
        ``expected_arrivals``."""
        with self._gate:  # the count and the queues as one submission left them
            start = self._arrived - self.queued()
        self.expected_arrivals = start - self._spell_start
        self._spell_start = start

    def _await_arrivals(self) -> None:
        """Idle, with requests waiting: wait until none arrived for the quiet window (a
        submission sets ``wake``), at most ``admission_wait_s``, until the waiting
        requests fill a prefill, or until as many wait as the last busy spell admitted
        (``expected_arrivals``: a synchronous loop's step sends its groups together, the
        same number every step, so the quiet window after the last one would only add
        its length to every step). Controls that arrive meanwhile run at the next turn
        of the loop, a few milliseconds later. A submission wakes the thread only once
        enough wait to end it (``submit``): each wake took the interpreter lock from the
        server's thread while it read the next request of the same batch; the others
        leave their time, from which the quiet window is counted."""
        if self.admission_quiet_s <= 0:
            return
        self.admission_waits += 1
        full = min(self.max_prefill, self.max_running)
        self._wake_at = min(full, self.expected_arrivals) if self.expected_arrivals > 0 else full
        try:
            deadline = time.perf_counter() + self.admission_wait_s
            while not self.stop_event.is_set() and self.waiting.qsize() < full:
                if 0 < self.expected_arrivals <= self.queued():
                    self.admitted_by_count += 1
                    return
                now = time.perf_counter()
                left, quiet = deadline - now, self._last_arrival + self.admission_quiet_s - now
                if left <= 0 or quiet <= 0:
                    return  # quiet: nothing more is on its way
                self.wake.clear()
                self.wake.wait(min(quiet, left))
        finally:
            self._wake_at = 0

    def _admit(self) -> None:
        """Take resumed and waiting requests while slots, the per-step count and the
        token budget allow (at least one), and prefill them together."""
        self._feed()
        batch: list[tuple[Request, bool]] = []
        tokens = 0

        def room() -> bool:
            return (
                len(self.running) + len(batch) < self.max_running
                and len(batch) < self.max_prefill
                and (not batch or tokens < self.max_prefill_tokens)
            )

        while self.retracted and room():
            req = self.retracted.pop(0)
            batch.append((req, True))
            tokens += len(req.input_ids) + len(req.output_ids)
        while room():
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                break
            if req.done:
                continue
            lora = getattr(self.runner, "lora", None)
            if req.lora is not None and (lora is None or req.lora not in lora.adapters):
                # unloaded between the server's check and this admission
                self.finish(req, _abort(f"LoRA adapter {req.lora!r} was unloaded"))
                continue
            if req.params.max_new_tokens == 0 and not req.return_logprob:
                self.finish(req, {"type": "length", "length": 0})
                continue
            batch.append((req, False))
            tokens += len(req.input_ids)
        if batch:
            self._prefilling = self._prefill(batch)
            self.prefilling = [req for req, _ in batch]
            self._advance_prefill()

    def _advance_prefill(self) -> None:
        """Run the pending prefill up to its next chunk boundary (all of it, when it fits
        one forward); its requests join ``running`` as it ends."""
        assert self._prefilling is not None
        began = self.clock()
        try:
            next(self._prefilling)
        except StopIteration:
            self._prefilling, self.prefilling = None, []
            return
        ended = self.clock()  # the running requests' turn: steps without a chunk
        self._next_chunk_at = ended + (ended - began) * self.decode_share / (1 - self.decode_share)

    def _drop_prefill(self, requeue: bool) -> None:
        """Stop the pending prefill: its requests give back their slots and, with
        ``requeue``, wait to be admitted again from the start (a retract)."""
        if self._prefilling is None:
            return
        self._prefilling.close()
        if requeue:
            for req in self.prefilling:
                if req.done:
                    continue
                self.pool.free(req)
                if req.output_ids:  # a retracted one: prompt and output again, as before
                    self.retracted.append(req)
                else:
                    self.waiting.put(req)
            self.prefilling = []
        self._prefilling = None

    def _prefill(self, batch: list[tuple[Request, bool]]) -> Generator[None, None, None]:
        """Prefill admitted requests: a resumed one its prompt and output but the last
        token (its next token comes from this step's decode), a new one its input after
        the cached prefix; then sample each new request's first token. A generator that
        stops between chunks (``_forward_rows``), so decode steps run in between."""
        rows: list[_Row] = []
        leaders: dict[tuple[Any, ...], _Row] = {}
        followers: list[tuple[Request, _Row]] = []
        for req, resumed in batch:
            try:
                self._start(req)
                tokens = req.input_ids + req.output_ids if resumed else req.input_ids
                if resumed:
                    rows.append(_Row(req, tokens[:-1], 0, None, resumed=True))
                    continue
                start = req.logprob_start_len if req.return_logprob else None
                key = (req.lora, start, tuple(tokens))
                if key in leaders:  # the same input: run once (with or without the cache)
                    followers.append((req, leaders[key]))
                    leaders[key].followers += 1
                    continue
                row = _Row(req, tokens, 0, start)
                leaders[key] = row
                rows.append(row)
            except Exception as err:
                log.exception("prefill of request %s failed", req.rid)
                self.fail(req, f"prefill failed: {_words(err)}")
        rows = [r for r in rows if not r.req.done]
        # the prompts run in a pool of their own, sized to them; from there each request
        # gets a slot of the running pool holding its prompt, or reading it (shared)
        wave = self.runner.new_pool(
            max(len(rows), 1), slots=len(rows), tokens=max((len(r.tokens) for r in rows), default=1)
        )
        for row in rows:
            try:
                wave.alloc(row)
                if not row.resumed:
                    start = row.logits_from
                    row.reused = self._reuse(wave, row, start)
                    row.logits_from = None if start is None else start - row.reused
                    # a group reads one copy of its prompt, unless it reads a cached
                    # prefix of it already (then each sample copies only the rest)
                    row.shared = (
                        self.share_min_tokens is not None
                        and row.followers > 0
                        and len(row.tokens) >= self.share_min_tokens
                        and wave.prefix(row.at) is None
                    )
            except Exception as err:
                log.exception("prefill of request %s failed", row.req.rid)
                self.fail(row.req, f"prefill failed: {_words(err)}")
        yield from self._run_rows(wave, [r for r in rows if not r.req.done])
        firsts: list[tuple[Request, torch.Tensor]] = []  # first tokens to draw, in order
        places: list[tuple[Request, _Row]] = []  # (request, the row its prompt ran in)
        for row in rows:
            if row.req.done or row.logits is None:
                continue
            if row.resumed:
                places.append((row.req, row))
                continue
            if self._first_token(wave, row, firsts):
                places.append((row.req, row))
        for req, leader in followers:
            if req.done:
                continue
            try:
                if leader.last is None:
                    raise RuntimeError("the request it shares its input with failed")
                if self._follow(req, leader, firsts):
                    places.append((req, leader))
            except Exception as err:
                log.exception("prefill of request %s failed", req.rid)
                self.fail(req, f"prefill failed: {_words(err)}")
        self._place(wave, places)
        for row in rows:
            if row.resumed and not row.req.done:
                self.running.append(row.req)
        self._first_tokens([(req, logits) for req, logits in firsts if not req.done])

    def _place(self, wave: KVPool, places: list[tuple[Request, _Row]]) -> None:
        """Give each request a slot of the running pool: one reading its row's prompt in
        ``wave`` once copied out of it (a shared row: a group's n samples read one copy),
        or holding a copy of it (all copied in one indexed copy per pool tensor)."""
        copies: list[tuple[int, int, int]] = []
        copied: list[Request] = []
        for req, row in places:
            try:
                slot = self.pool.alloc(req)
                if row.shared:
                    self.pool.attach(slot, self._shared(wave, row))
                else:
                    copies.append((row.at, slot, len(row.tokens)))
                    copied.append(req)
            except Exception as err:
                log.exception("prefill of request %s failed", req.rid)
                self.fail(req, f"prefill failed: {_words(err)}")
        try:
            self.pool.load_from(wave, copies)
        except Exception as err:
            log.exception("copying the KV of %d prefilled requests failed", len(copied))
            for req in copied:
                self.fail(req, f"prefill failed: {_words(err)}")

    def _first_tokens(self, firsts: list[tuple[Request, torch.Tensor]]) -> None:
        """Each new request's first token, drawn together as a decode step draws (a
        GRPO group's n samples share their prompt's logits: one batched draw, not n)."""
        if not firsts:
            return
        batch = [req for req, _ in firsts]
        try:
            logits_BV = torch.stack([logits for _, logits in firsts])
            drawn = self._draw(batch, logits_BV)
        except Exception:  # each alone then, where a failure is the request's own
            log.exception("batched first-token sampling failed; sampling one by one")
            drawn = {}
        self._settling = []  # those whose first token ends them are answered together
        try:
            for i, (req, logits) in enumerate(firsts):
                try:
                    self._emit(req, logits, drawn.get(i))
                except Exception as err:
                    log.exception("prefill of request %s failed", req.rid)
                    self.fail(req, f"prefill failed: {_words(err)}")
                    continue
                if not req.done:
                    self.running.append(req)
        finally:
            self._settle()

    def _start(self, req: Request) -> None:
        """The request's sampler and stop-string tail length (once)."""
        if req.sampler is not None:
            return
        req.sampler = Sampler(
            req.params,
            self.runner.vocab_size,
            self.runner.generator,
            stop_ids=set(req.params.stop_token_ids or ()) | self.eos,
            matcher=req.matcher,
        )
        if req.params.stop_strs and not req.params.stop_regexes:
            req.stop_tail = 1 + max(
                len(self.tokenizer.encode(s, add_special_tokens=False))
                for s in req.params.stop_strs
            )

    def _run_rows(self, pool: KVPool, rows: list[_Row]) -> Iterator[None]:
        """Forward the rows' new tokens, in forwards of at most ``--chunked-prefill-size``
        tokens, stopping (a ``yield``) between them; a batch that raises is run again one
        row at a time to find the failing requests. Sets each row's logits and routes
        (routes: none for a resumed row, whose tokens' rows were recorded when they were
        first processed)."""
        if not rows:
            return
        lengths = [pool.length(r.at) for r in rows]
        try:
            yield from self._forward_rows(pool, rows)
        except Exception as err:
            for row, length in zip(rows, lengths):  # drop what the failed forward wrote
                if not row.req.done:
                    pool.set_length(row.at, length)
                row.logits, row.routes = None, []
            if len(rows) == 1:
                log.exception("prefill of request %s failed", rows[0].req.rid)
                self.fail(rows[0].req, f"prefill failed: {_words(err)}")
                return
            log.warning("batched prefill failed (%s); prefilling one by one", _words(err))
            for row in rows:
                if not row.req.done:
                    yield from self._run_rows(pool, [row])

    def _forward_rows(self, pool: KVPool, rows: list[_Row]) -> Iterator[None]:
        done = [0] * len(rows)  # tokens of each row already run
        pieces: list[list[torch.Tensor]] = [[] for _ in rows]
        chunks = 0
        while True:
            budget = self.chunk or sum(len(r.tokens) for r in rows)
            take = []
            for i, row in enumerate(rows):
                left = len(row.tokens) - row.reused - done[i]
                if left > 0 and budget > 0 and not row.req.done:  # done: aborted meanwhile
                    take.append((i, min(left, budget)))
                    budget -= min(left, budget)
            if not take:
                break
            if chunks:  # between two chunks: the running requests decode a token
                yield
                take = [(i, n) for i, n in take if not rows[i].req.done]
                if not take:
                    break
            chunks += 1
            # logits wanted: the row's last token, or its positions logits_from..
            froms = [_relative(rows[i].logits_from, done[i]) for i, _ in take]
            logits, routes = self.runner.extend(
                pool,
                [rows[i].at for i, _ in take],
                [
                    rows[i].tokens[rows[i].reused + done[i] : rows[i].reused + done[i] + n]
                    for i, n in take
                ],
                [rows[i].req.lora for i, _ in take],
                [None if f is None or f >= n else f for f, (_, n) in zip(froms, take)],
            )
            for (i, n), got, rows_TLK, first in zip(take, logits, routes, froms):
                done[i] += n
                if not rows[i].resumed:
                    rows[i].routes.append(rows_TLK)
                if first is not None and first < n:
                    pieces[i].append(got)
                elif done[i] + rows[i].reused == len(rows[i].tokens):
                    pieces[i].append(got[None])
        for i, row in enumerate(rows):
            if row.req.done:
                continue
            if row.logits_from is None:
                row.logits = pieces[i][-1][-1]
            else:
                row.logits = torch.cat(pieces[i]) if pieces[i] else None

    def _first_token(
        self, wave: KVPool, row: _Row, firsts: list[tuple[Request, torch.Tensor]]
    ) -> bool:
        """After a new request's prefill (in ``wave``): its routes and input logprobs; the
        logits of its first token join ``firsts``. False when it ended here."""
        req, tokens = row.req, row.tokens
        try:
            for rows_TLK in row.routes:
                self._record(req, rows_TLK)
            start = req.logprob_start_len if req.return_logprob else None
            if (start is None or start >= len(tokens) - 1) and row.reused < len(tokens) - 1:
                # the prompt's KV and routes, cached now: the other samples of its group
                # (and any request sharing the prompt) admitted after it prefill only
                # their last token. Its finished sequence replaces this entry later.
                self._keep_prompt(wave, row)
            logits = row.logits
            assert logits is not None
            if start is not None:
                self._input_logprobs(req, tokens, logits)
                logits = logits[-1]
            row.last = logits
            if req.params.max_new_tokens == 0:
                self.finish(req, {"type": "length", "length": 0})
                return False
        except Exception as err:
            log.exception("prefill of request %s failed", req.rid)
            self.fail(req, f"prefill failed: {_words(err)}")
            return False
        firsts.append((req, logits))
        return True

    def _follow(
        self, req: Request, leader: _Row, firsts: list[tuple[Request, torch.Tensor]]
    ) -> bool:
        """A request with the same input as ``leader``, admitted with it: its routes and
        input logprobs are the leader's (the prefix cache's role within one step, also
        without the cache), its KV the leader's prompt (``_place``), and its first token is
        drawn from the leader's logits (``firsts``). Its ``cached_tokens`` count the
        prompt only with the cache on (SGLang reports none without it). False when it
        ended here."""
        n = len(leader.tokens)
        req.cache_epoch = leader.req.cache_epoch
        req.cached_tokens = n if self.prefix_cache is not None else 0
        for rows_TLK in leader.req.routes:
            self._record(req, rows_TLK)
        req.input_logprobs = list(leader.req.input_logprobs)
        req.input_top_logprobs = list(leader.req.input_top_logprobs)
        req.input_ids_logprobs = list(leader.req.input_ids_logprobs)
        if req.params.max_new_tokens == 0:
            self.finish(req, {"type": "length", "length": 0})
            return False
        assert leader.last is not None
        firsts.append((req, leader.last))
        return True

    def _reuse(self, wave: KVPool, row: _Row, logits_from: int | None) -> int:
        """Seed the row's slot of ``wave`` and its request's routes with the longest
        cached prefix of its tokens and return its length: at most all but the last token
        (its logits are needed), and no further than ``logits_from`` (input logprobs are
        computed from there on, as SGLang caps the match at logprob_start_len). A prefix
        of at least ``--shared-prompt-min-tokens`` is read where the cache holds it (the
        slot, and the running slots of the row's requests after it, read it as their
        ``Prefix``: a turn of an episode, or a sample sent apart from its group, holds the
        cached tokens once); a shorter one is copied."""
        cache = self.prefix_cache
        req, tokens = row.req, row.tokens
        if cache is None:
            return 0
        req.cache_epoch = cache.epoch(req.lora)
        limit = len(tokens) - 1 if logits_from is None else min(len(tokens) - 1, logits_from)
        hit = cache.match(req.lora, tokens, limit)
        if hit is None:
            return 0
        seq, n = hit.sequence, hit.length
        if self.share_min_tokens is not None and n >= self.share_min_tokens:
            wave.attach(row.at, Prefix(seq.keys, seq.values, n))
        else:
            wave.load(row.at, [k[:, :n] for k in seq.keys], [v[:, :n] for v in seq.values])
        self._record(req, seq.routes_TLK[:n])
        req.cached_tokens = n
        return n

    def _keep(self, *requests: Request) -> None:
        """Hand finished requests' processed tokens (all but the last sampled one), their
        KV and routes to the prefix cache (the KV of all of them exported together)."""
        cache = self.prefix_cache
        if cache is None:
            return
        kept: list[tuple[Request, int, tuple[int, int], list[int], np.ndarray]] = []
        for req in requests:
            if req.cache_epoch is None or req.slot is None:
                continue
            n = self.pool.length(req.slot)
            if not n:
                continue
            tokens = (req.input_ids + req.output_ids)[:n]
            routes_TLK = np.concatenate(req.routes, axis=0) if req.routes else None
            if routes_TLK is None or len(routes_TLK) != n or len(tokens) != n:
                log.warning("request %s: KV and routes disagree; not cached", req.rid)
                continue
            kept.append((req, req.slot, req.cache_epoch, tokens, routes_TLK))
        exported = self.pool.export_many([(slot, len(t)) for _, slot, _, t, _ in kept])
        for (req, _, epoch, tokens, routes_TLK), (keys, values) in zip(kept, exported):
            seq = Sequence(np.asarray(tokens, dtype=np.int64), keys, values, routes_TLK)
            cache.insert(req.lora, seq, epoch)

    def _shared(self, wave: KVPool, row: _Row) -> Prefix:
        """The copy of a shared row's prompt (its row of ``wave``) that its group reads and
        the prefix cache keeps: one copy, exactly as long as the prompt, made once, so the
        prefill's pool (its rows padded to the longest prompt) goes when the prefill ends."""
        if row.prefix is None:
            n = len(row.tokens)
            row.prefix = Prefix(*wave.export(row.at, n), n)
        return row.prefix

    def _keep_prompt(self, wave: KVPool, row: _Row) -> None:
        """Hand a just-prefilled prompt (its row of ``wave``) to the prefix cache: the copy
        its group reads when it shares it, else a copy of its own."""
        cache, req = self.prefix_cache, row.req
        if cache is None or req.cache_epoch is None:
            return
        n = len(row.tokens)
        routes_TLK = np.concatenate(req.routes, axis=0) if req.routes else None
        if routes_TLK is None or len(routes_TLK) != n or wave.length(row.at) != n:
            log.warning("request %s: KV and routes disagree; not cached", req.rid)
            return
        if row.shared:
            prefix = self._shared(wave, row)
            keys, values = prefix.held_keys, prefix.held_values
        else:
            keys, values = wave.export(row.at, n)
        seq = Sequence(np.asarray(row.tokens, dtype=np.int64), keys, values, routes_TLK)
        cache.insert(req.lora, seq, req.cache_epoch)

    def _input_logprobs(self, req: Request, tokens: list[int], logits_SV: torch.Tensor) -> None:
        """SGLang's input-token logprobs of prompt positions logprob_start_len.. : None for
        the first (nothing before it is scored), then each token given those before it."""
        with self.runner.numerics():
            logprobs = prompt_logprobs(logits_SV[:-1], req.params)
        targets = torch.tensor(
            tokens[req.logprob_start_len + 1 :], dtype=torch.long, device=logprobs.device
        )
        picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        req.input_logprobs = [None, *picked]
        if req.top_logprobs_num > 0:
            k = min(req.top_logprobs_num, logprobs.shape[-1])
            values, ids = torch.topk(logprobs, k, dim=-1)
            rows = [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
            req.input_top_logprobs = [None, *rows]
        if req.token_ids_logprob:
            req.input_ids_logprobs = [None, *logprobs[:, req.token_ids_logprob].tolist()]

    def _decode(self) -> None:
        # slot order: the running requests hold slots 0..B-1, read as one view
        batch = sorted(self.running, key=lambda r: r.slot if r.slot is not None else -1)
        try:
            self._decode_batch(batch)
        except Exception as err:
            if len(batch) == 1:
                log.exception("decode of request %s failed", batch[0].rid)
                self.fail(batch[0], f"decode failed: {_words(err)}")
            else:  # find the requests that fail: each alone
                log.warning("batched decode failed (%s); decoding one by one", _words(err))
                for req in batch:
                    try:
                        self._decode_batch([req])
                    except Exception as one:
                        log.exception("decode of request %s failed", req.rid)
                        self.fail(req, f"decode failed: {_words(one)}")
        self.running = [r for r in batch if not r.done]

    def _decode_batch(self, batch: list[Request]) -> None:
        slots = [r.slot for r in batch]
        if None in slots:
            raise RuntimeError("a running request holds no KV slot")
        logits, routes = self.runner.decode(
            self.pool,
            slots,  # type: ignore[arg-type]
            [r.output_ids[-1] for r in batch],
            [r.lora for r in batch],
        )  # a forward that raises leaves the slots' lengths as they were
        drawn = self._draw(batch, logits)
        self._settling = []  # the requests this step finishes are answered first
        try:
            for i, req in enumerate(batch):
                try:
                    self._record(req, routes[i : i + 1])
                    self._emit(req, logits[i], drawn.get(i))
                except Exception as err:  # sampling or the stream callback: this one only
                    log.exception("sampling of request %s failed", req.rid)
                    self.fail(req, f"sampling failed: {_words(err)}")
        finally:
            self._settle()

    def _draw(self, batch: list[Request], logits_BV: torch.Tensor) -> dict[int, Sampled]:
        """The next token of each request whose draw needs nothing of its own (finite
        logits, ``Sampler.batchable``): one batched draw per set of sampling parameters.
        Row → Sampled; the others are sampled alone by ``_emit``."""
        finite = torch.isfinite(logits_BV).all(dim=-1).tolist()
        drawn: dict[int, Sampled] = {}
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, req in enumerate(batch):
            assert req.sampler is not None
            if finite[i] and req.sampler.batchable(req.top_logprobs_num, req.token_ids_logprob):
                p = req.params
                key = (p.greedy, p.temperature, p.top_k, p.top_p, p.min_p)
                groups.setdefault(key, []).append(i)
        for rows in groups.values():
            try:  # batch-invariant softmaxes with the engine's mode, called directly
                got = sample_batch(
                    logits_BV[rows],
                    batch[rows[0]].params,
                    self.runner.generator,
                    [batch[i].return_sampling_mask for i in rows],
                    invariant=self.runner.deterministic,
                )
            except Exception:  # each alone then, where a failure is the request's own
                log.exception("batched sampling failed; sampling one by one")
                continue
            drawn.update(zip(rows, got))
        return drawn

    def _record(self, req: Request, routes: np.ndarray) -> None:
        if req.return_routed_experts or self.prefix_cache is not None:
            req.routes.append(routes)

    def _emit(self, req: Request, logits: Any, drawn: Sampled | None = None) -> None:
        """Sample the next token of ``req`` (or take the one ``sample_batch`` drew from
        these logits) and finish it if a stop condition holds."""
        assert req.sampler is not None
        if drawn is not None:
            req.sampler.accept(drawn.token)
            self._append(req, drawn)
            return
        if not bool(torch.isfinite(logits).all()):
            adapter = f" with LoRA adapter {req.lora!r}" if req.lora else ""
            self.fail(
                req,
                f"the model's logits at output token {len(req.output_ids)} are not finite "
                f"(NaN or inf){adapter}: the weights produce NaN; request aborted",
            )
            return
        try:
            with self.runner.numerics():
                s = req.sampler.sample(logits, req.top_logprobs_num, req.token_ids_logprob)
        except ValueError as err:  # nothing possible: the request's own constraints
            self.fail(req, f"output token {len(req.output_ids)}: {err}", 400)
            return
        self._append(req, s)

    def _append(self, req: Request, s: Sampled) -> None:
        """Record a sampled token and finish the request if a stop condition holds."""
        req.output_ids.append(s.token)
        req.logprobs.append(s.logprob)
        req.versions.append(self.weight_version)
        if req.top_logprobs_num > 0:
            req.top_logprobs.append(s.top)
        if req.token_ids_logprob:
            req.ids_logprobs.append(s.chosen)
        if req.return_sampling_mask:
            req.masks.append(s.mask)
            req.sampling_logprobs.append(
                s.support_logprobs
                if req.sampling_logprobs_mode == "support"
                else s.sampling_logprob
            )
        reason = self._finish_reason(req)
        if reason is not None:
            self.finish(req, reason)
        if req.on_token is not None:
            req.on_token(req)

    def _finish_reason(self, req: Request) -> dict[str, Any] | None:
        """SGLang's order (``Req.update_finish_state``): stop string or stop_regex, then
        stop token or EOS (none with ignore_eos), then length, then a finished grammar."""
        params, token = req.params, req.output_ids[-1]
        if params.stop_strs or params.stop_regexes:
            tail = self._tail(req)
            for stop in params.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
            for pattern in params.stop_regexes:
                try:
                    hit = pattern.search(tail, timeout=self.stop_regex_timeout_s)
                except TimeoutError:
                    return _abort(
                        f"stop_regex {pattern.pattern!r} took over "
                        f"{1e3 * self.stop_regex_timeout_s:g} ms to search {len(tail)} "
                        "characters of output (a pattern that backtracks catastrophically, "
                        "such as nested quantifiers); request aborted. Simplify the pattern "
                        "(or raise the engine's --stop-regex-timeout-ms)",
                        400,
                    )
                if hit:
                    return {"type": "stop", "matched": pattern.pattern}
        if not params.ignore_eos and (token in self.eos or token in (params.stop_token_ids or ())):
            return {"type": "stop", "matched": token}
        n = len(req.output_ids)
        if params.max_new_tokens is not None and n >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.matcher is not None and req.matcher.done:
            return {"type": "stop", "matched": token}
        if len(req.input_ids) + n >= self.runner.context_len:
            return {"type": "length", "length": n}
        return None

    def _tail(self, req: Request) -> str:
        """The decoded end of the output, long enough for every stop string (SGLang's
        ``tail_str``); stop_regex patterns see the whole output."""
        ids = req.output_ids[-req.stop_tail :] if req.stop_tail else req.output_ids
        return str(self.tokenizer.decode(ids))


@dataclass
class _Row:
    """One request in a prefill: the tokens its slot ends with after the prefill (the
    first ``reused`` from the prefix cache), where its input logprobs start (relative to
    the new tokens), and what the forwards gave back."""

    req: Request
    tokens: list[int]
    reused: int
    logits_from: int | None
    resumed: bool = False
    routes: list[np.ndarray] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [V], or [S', V] from logits_from
    last: torch.Tensor | None = None  # the logits the first token is sampled from
    slot: int | None = None  # its slot in the prefill's own KV pool
    followers: int = 0  # requests admitted with it that have the same input
    shared: bool = False  # its requests read one copy of its prompt's KV (``prefix``)
    prefix: Prefix | None = None  # that copy, once made

    @property
    def at(self) -> int:
        """Its slot in the prefill's KV pool (allocated)."""
        assert self.slot is not None
        return self.slot


def _relative(first: int | None, done: int) -> int | None:
    """A row's logits_from counted from its next chunk, ``done`` tokens in."""
    return None if first is None else max(0, first - done)


def _abort(message: str, status_code: int | None = None) -> dict[str, Any]:
    """SGLang's abort finish reason; a status >= 400 makes it an HTTP error response."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


def _slot_of(request: Request) -> int:
    return -1 if request.slot is None else request.slot


def _words(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


_counter = itertools.count()


def new_rid() -> str:
    return f"{uuid.uuid4().hex[:12]}{next(_counter)}"


def own_torch_threads(threads: int) -> None:
    """Run the calling thread's torch CPU ops on ``threads`` threads, leaving every other
    thread's count, and the count new threads start with, as they were. With OpenMP
    (torch's CPU backend on Linux and macOS) the count is each thread's own;
    ``torch.set_num_threads`` also changes the default later threads take up, which a
    helper thread sets back. Elsewhere the count is the process's and this sets it."""
    before = torch.get_num_threads()  # this thread's, taken up from the default
    torch.set_num_threads(threads)
    if before != threads:
        helper = threading.Thread(target=torch.set_num_threads, args=(before,))
        helper.start()
        helper.join()
        if torch.get_num_threads() != threads:  # one count for the process: ours wins
            torch.set_num_threads(threads)
