"""Shared prompt KV (moerl/engine/core/scheduler.py ``_place``, moerl/engine/core/kv_pool.py
``Prefix``): the samples of a group admitted together read one copy of their prompt's KV.

Each scenario runs twice on one model, once with sharing (every prompt of a group shared)
and once with every prompt copied to each sample (the engine's layout before sharing),
and the two must generate the same tokens with the same logprobs and routes; the shared
run must have shared (``attached``) and must hold less KV."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import pytest

from moerl.engine.core.model_runner import ModelRunner
from moerl.engine.core.prefix_cache import PrefixCache
from moerl.engine.core.sampling import SamplingParams
from moerl.engine.core.scheduler import Request, Scheduler


def _scheduler(runner: ModelRunner, share: int | None) -> Scheduler:
    return Scheduler(
        runner,
        prefix_cache=PrefixCache(100_000),
        enable_routed_experts=True,
        shared_prompt_min_tokens=share,
    )


def _run(
    sched: Scheduler,
    batches: list[list[tuple[list[int], int]]],
    on_token: Callable[[Request], None] | None = None,
) -> list[Request]:
    """Submit each batch of (prompt, max_new_tokens) at once (one admission), greedy, and
    wait for it to be answered before the next; returns every request."""
    out: list[Request] = []
    sched.start()
    try:
        for k, batch in enumerate(batches):
            left, done, lock = [len(batch)], threading.Event(), threading.Lock()

            def on_done(_: Request, left=left, done=done, lock=lock) -> None:  # type: ignore[no-untyped-def]
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

            reqs = [
                Request(
                    rid=f"b{k}r{i}",
                    input_ids=list(prompt),
                    on_done=on_done,
                    on_token=on_token,
                    return_logprob=True,  # output logprobs; none of the prompt's, so a
                    logprob_start_len=len(prompt) - 1,  # prompt may come from the cache
                    params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                )
                for i, (prompt, n) in enumerate(batch)
            ]
            sched.submit(*reqs)
            assert done.wait(120), "the requests were never answered"
            out += reqs
    finally:
        sched.shutdown()
    return out


def _same(shared: list[Request], copied: list[Request]) -> None:
    for a, b in zip(shared, copied, strict=True):
        assert a.finish_reason == b.finish_reason, a.rid
        assert a.output_ids == b.output_ids, a.rid
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.concatenate(a.routes), np.concatenate(b.routes))
        assert a.cached_tokens == b.cached_tokens, a.rid


@pytest.fixture(scope="module")
def runner(tiny_checkpoints) -> ModelRunner:
    return ModelRunner(tiny_checkpoints["deepseek_moe"])


def test_shared_groups_generate_what_copied_groups_do(runner):
    """Three groups of four samples with prompts of different lengths, finishing at
    different steps (a leader after its first token), beside two single requests whose
    prompts are copied, in one admission; then a second admission whose prompt extends a
    group's prompt (a prefix-cache hit on the shared prompt's entry)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, n).tolist() for n in (9, 14, 6)]
    singles = [rng.integers(3, 100, n).tolist() for n in (7, 11)]
    first = [(p, n) for i, p in enumerate(prompts) for n in ((1, 6, 3, 6) if i == 0 else (5,) * 4)]
    first += [(p, 4) for p in singles]
    second = [(prompts[1] + [5, 6, 7], 4)] * 2
    results, pools = {}, {}
    for share in (1, None):
        sched = _scheduler(runner, share)
        results[share] = _run(sched, [first, second])
        pools[share] = sched.pool
    _same(results[1], results[None])
    # every sample of the first admission's groups read its group's prompt; the second
    # admission's pair too; the singles were copied
    assert pools[1].attached == 12 + 2 and pools[None].attached == 0
    # the second leader reused the first group's prompt from the cache (its follower, as
    # every follower, counts its whole input as cached)
    assert results[1][-2].cached_tokens == len(prompts[1])
    assert pools[1].used == 0 and pools[1].shared == 0  # (memory: the next test)


def test_a_group_of_eight_holds_one_copy_of_its_prompt(tiny_checkpoints, tmp_path):
    """Issue 29's target: a group of 8 on a 512-token prompt holds at most 1.3 times the KV
    of one prompt and 8 responses (the running pool's slots and the prompt they read);
    copied, it holds one prompt per sample, in slots as long as prompt + response."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config("qwen3_moe"), max_position_embeddings=1024)
    runner = ModelRunner(save_tiny_checkpoint(cfg, tmp_path / "hf"))
    prompt = np.random.default_rng(1).integers(3, 100, 512).tolist()
    new = 32
    peaks = {}
    for share in (256, None):
        sched = _scheduler(runner, share)
        reqs = _run(sched, [[(prompt, new)] * 8])
        assert all(len(r.output_ids) == new for r in reqs)
        peaks[share] = sched.pool.peak_nbytes / sched.pool.token_nbytes()
    # tokens held: prompt + 8 responses' processed tokens (the last is sampled, not run)
    ideal = 512 + 8 * new
    assert peaks[256] <= 1.3 * ideal, peaks
    assert peaks[None] >= 8 * 512, peaks


def test_a_group_below_the_threshold_is_copied(runner):
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 100, 8).tolist()
    sched = _scheduler(runner, 9)
    _run(sched, [[(prompt, 3)] * 4])
    assert sched.pool.attached == 0


def test_a_retracted_group_resumes_with_its_tokens(runner):
    """Pausing with retract drops every running request's KV (the shared prompt's readers
    included); on continue each re-prefills its prompt and output and goes on as if never
    paused."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 100, 10).tolist()
    results, retracts = {}, {}
    for share in (1, None):
        sched = _scheduler(runner, share)
        count = {"retracts": 0}

        def retract(s: Scheduler = sched, count: dict = count) -> None:
            count["retracts"] += 1
            s.pause("retract")
            s.resume()

        def on_token(req: Request, s: Scheduler = sched, count: dict = count) -> None:
            if req.rid == "b0r0" and len(req.output_ids) == 3:  # once: the next step's turn
                s.control(retract, lambda *_: None)

        results[share] = _run(sched, [[(prompt, 8)] * 3], on_token=on_token)
        retracts[share] = count["retracts"]
    assert retracts == {1: 1, None: 1}
    assert results[1][0].finish_reason == {"type": "length", "length": 8}
    _same(results[1], results[None])


def test_a_group_reading_a_cached_prompt_holds_it_once(tiny_checkpoints, tmp_path):
    """A prompt the prefix cache holds (here: prefilled by an earlier request that only
    asked for its logprobs) is read where the cache keeps it by the group that arrives
    later: each sample prefills nothing but its last token and copies only that, so the
    group holds the prompt once (the cache's) and 8 responses; copied, once per sample.
    Both generate the same."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config("deepseek_moe"), max_position_embeddings=1024)
    runner = ModelRunner(save_tiny_checkpoint(cfg, tmp_path / "hf"))
    prompt = np.random.default_rng(4).integers(3, 100, 512).tolist()
    new, results, peaks, attached = 32, {}, {}, {}
    for share in (256, None):
        sched = _scheduler(runner, share)
        results[share] = _run(sched, [[(prompt, 0)], [(prompt, new)] * 8])
        peaks[share] = sched.pool.peak_nbytes / sched.pool.token_nbytes()
        attached[share] = sched.pool.attached
    _same(results[256], results[None])
    assert all(r.cached_tokens >= 511 for r in results[256][1:])
    assert attached == {256: 8, None: 0}
    assert peaks[256] <= 1.3 * (512 + 8 * new), peaks
    assert peaks[None] >= 8 * 512, peaks


def test_the_prompts_a_group_reads_are_copies_as_long_as_they_are(runner):
    """A long and a short prompt prefilled together share a prefill pool padded to the long
    one; each group then reads a copy of its own prompt exactly as long as it (the cache
    keeps that copy too), so nothing keeps the padded pool once the prefill ended."""
    rng = np.random.default_rng(6)
    long, short = rng.integers(3, 100, 60).tolist(), rng.integers(3, 100, 6).tolist()
    sched = _scheduler(runner, 1)
    seen: list[list[tuple[int, int, bool]]] = []

    def on_token(req: Request) -> None:
        if len(req.output_ids) == 1 and not seen:  # the first decode step's
            seen.append([(p.length, p.held_keys[0].shape[1]) for p in sched.pool.prefixes if p])

    _run(sched, [[(long, 3)] * 4 + [(short, 3)] * 4], on_token=on_token)
    assert sorted(seen[0]) == [(6, 6)] * 4 + [(60, 60)] * 4
    cache = sched.prefix_cache
    assert cache is not None and cache.match(None, short, 6) is not None


def test_without_the_prefix_cache_a_group_still_prefills_its_prompt_once(runner, monkeypatch):
    """An engine without the prefix cache (--disable-radix-cache) still runs the samples
    of a group admitted together as one prefill row, shares its prompt's KV, and answers
    as the engine with the cache; only ``cached_tokens`` reads 0, as SGLang reports."""
    rng = np.random.default_rng(5)
    group, other = rng.integers(3, 100, 12).tolist(), rng.integers(3, 100, 7).tolist()
    batch = [[(group, 4)] * 4 + [(other, 4)]]
    rows: list[int] = []
    extend = runner.extend

    def counted(pool, slots, tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append(len(slots))
        return extend(pool, slots, tokens, *args, **kwargs)

    monkeypatch.setattr(runner, "extend", counted)
    bare = Scheduler(runner, prefix_cache=None, enable_routed_experts=True,
                     shared_prompt_min_tokens=1)  # fmt: skip
    without = _run(bare, batch)
    assert rows == [2]  # one row per distinct prompt, not one per sample
    assert bare.pool.attached == 4  # the group's samples read one copy of its prompt
    rows.clear()
    with_cache = _run(_scheduler(runner, 1), batch)
    assert rows == [2]
    for a, b in zip(without, with_cache, strict=True):
        assert a.output_ids == b.output_ids, a.rid
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    assert [r.cached_tokens for r in without] == [0] * 5
    assert [r.cached_tokens for r in with_cache] == [0, 12, 12, 12, 0]
