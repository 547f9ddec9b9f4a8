"""A GRPO group's first tokens: the n samples of one prompt are prefilled once and their
first tokens drawn in one batched draw (moerl.engine.core.scheduler ``_first_tokens``), each
with the prompt's own next-token logprob, as transformers computes it."""

from __future__ import annotations

import threading

import pytest
import torch


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):  # type: ignore[no-untyped-def]
    from moerl.engine.cli import parse_args
    from moerl.engine.launch import build_state

    path = tiny_checkpoints["deepseek_moe"]
    state = build_state(parse_args(["--model-path", str(path)])).state.engine
    state.scheduler.start()
    yield path, state
    state.scheduler.shutdown()


def _run(state, bodies):  # type: ignore[no-untyped-def]
    from moerl.engine.native.generate import parse_generate

    reqs = [r for body in bodies for r in parse_generate(state, body)]
    done = threading.Semaphore(0)
    for r in reqs:
        r.on_done = lambda _r: done.release()
    state.scheduler.submit(*reqs)
    for _ in reqs:
        assert done.acquire(timeout=60)
    return reqs


def test_a_groups_first_tokens_come_from_one_draw(engine, monkeypatch):  # type: ignore[no-untyped-def]
    """Two groups of n=4 admitted together: one batched draw of 8 rows for the first
    tokens (was 8 draws of one row), and each first token's logprob is transformers'
    log-softmax of the prompt's last logits."""
    from transformers import AutoModelForCausalLM

    from moerl.engine.core import scheduler

    path, state = engine
    sizes: list[int] = []
    real = scheduler.sample_batch

    def counting(logits_BV, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(len(logits_BV))  # then the real draw
        return real(logits_BV, *args, **kwargs)

    monkeypatch.setattr(scheduler, "sample_batch", counting)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = {"max_new_tokens": 1, "temperature": 1.0, "n": 4, "ignore_eos": True}
    reqs = _run(state, [{"input_ids": p, "sampling_params": sampling} for p in prompts])
    assert sizes == [8]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for req in reqs:
        with torch.no_grad():
            logits = model(torch.tensor([req.input_ids])).logits[0, -1]
        want = torch.log_softmax(logits, -1)[req.output_ids[0]].item()
        assert req.logprobs[0] == pytest.approx(want, abs=1e-5)
