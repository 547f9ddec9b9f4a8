"""SGLang's own Python frontend against the embedded engine: ``sgl.gen`` with ``max_tokens``,
greedy, ``stop`` strings, ``regex`` and ``gen_int``, streaming, ``run_batch``, ``fork`` and
``sgl.select`` return what the request asked for.

The frontend is SGLang 0.5.23 installed with ``pip install --no-deps sglang==0.5.23``
(Python >= 3.11) plus the modules it imports, which the ``test`` extra holds; without it
these tests skip. It runs in a worker process (``sglang_programs``) so that its patches to
transformers stay out of this session. The references do not go through the frontend: the
engine's raw /generate for what greedy decoding gives, Python's ``re`` for regexes, and
transformers' model for ``select``'s normalized prompt logprobs.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sglang_programs as programs
import torch

PROMPT = "1+1="
TIMEOUT_S = 120.0  # a whole program (the frontend's HTTP calls time out at 60 s each)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def frontend() -> Iterator[Any]:
    """A worker process that runs ``sglang_programs`` functions; skips without sglang."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            pool.apply(programs.version)
        except ImportError as err:
            pytest.skip(
                f"SGLang's frontend is not importable ({err}): pip install --no-deps "
                "sglang==0.5.23 (Python >= 3.11) and the test extra"
            )

        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return pool.apply_async(fn, args, kwargs).get(timeout=TIMEOUT_S)

        yield run


@pytest.fixture(scope="module")
def engine(frontend, tiny_checkpoints, engine_factory) -> str:
    return engine_factory(tiny_checkpoints["qwen3_moe"]).url


def greedy(url: str, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """The engine's raw greedy completion of ``prompt`` (no frontend involved)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    r = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_gen_greedy_with_max_tokens(frontend, engine):
    ref = greedy(engine, PROMPT, 6)
    out, meta = frontend(programs.gen, engine, PROMPT, max_tokens=6, temperature=0)
    assert out == ref["text"]
    assert meta["completion_tokens"] == len(ref["output_ids"]) <= 6
    assert meta["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_gen_stops_at_a_stop_string_and_trims_it(frontend, engine):
    text = greedy(engine, PROMPT, 12)["text"]
    assert len(text) >= 3, f"the greedy text {text!r} is too short to cut; pick another PROMPT"
    stop = text[-2:]
    out, meta = frontend(
        programs.gen, engine, PROMPT, max_tokens=12, temperature=0, stop=[stop, "never seen"]
    )
    assert out == text[: text.find(stop)]
    assert stop not in out
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("regex", [r"[0-9]{3}", r"(cat|dog)s?", r"\(1[+-]2\)=[0-9]"])
def test_gen_regex_output_fullmatches(frontend, engine, regex):
    out, _ = frontend(programs.gen, engine, PROMPT, max_tokens=16, temperature=0, regex=regex)
    assert re.fullmatch(regex, out), out


def test_gen_int_is_an_integer(frontend, engine):
    """gen_int: SGLang's integer regex with " " and "\\n" as stop strings (trimmed)."""
    out = frontend(programs.gen_int, engine, "n=", max_tokens=8)
    assert re.fullmatch(r"[-+]?[0-9]+", out), out


def test_streaming_gives_the_text_in_pieces(frontend, engine):
    text = greedy(engine, PROMPT, 6)["text"]
    assert len(text) >= 2, f"the greedy text {text!r} is too short to stream in pieces"
    chunks, final = frontend(programs.gen_stream, engine, PROMPT, max_tokens=6, temperature=0)
    assert "".join(chunks) == final == text
    assert len([c for c in chunks if c]) >= 2, chunks


def test_run_batch_answers_each_program(frontend, engine):
    prompts = [PROMPT, "x=(", "the cat "]
    outs = frontend(programs.gen_batch, engine, prompts, max_new_tokens=6, temperature=0)
    assert outs == [greedy(engine, p, 6)["text"] for p in prompts]


def test_fork_continues_each_branch_from_the_shared_prefix(frontend, engine):
    suffixes = ["0", "(1"]
    outs, text = frontend(programs.fork, engine, PROMPT, suffixes, max_tokens=4)
    assert outs == [greedy(engine, PROMPT + s, 4)["text"] for s in suffixes]
    assert text == PROMPT + "|".join(outs)


@pytest.fixture(scope="module")
def model(tiny_checkpoints) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    from moerl.models.tokenizer import load_tokenizer

    path = tiny_checkpoints["qwen3_moe"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf, load_tokenizer(path)


def normalized_prompt_logprob(model: tuple[Any, Any], prefix: str, choice: str) -> float:
    """SGLang's select score, written out: it asks for input logprobs from the prefix's
    second-to-last token, whose own entry has none, so the mean runs over the prefix's
    last token and the choice's tokens. (Its token-healing branch, taken when the text
    ends with that second-to-last token, is avoided by the prefixes used here.)"""
    hf, tokenizer = model
    ids = tokenizer(prefix + choice).input_ids
    first = len(tokenizer(prefix).input_ids) - 1
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    values = [logprobs[j - 1, ids[j]].item() for j in range(first, len(ids))]
    return sum(values) / len(values)


@pytest.mark.parametrize(
    "prefix, choices", [("q: 2+2=", ["4", "5", "22"]), ("the cat is ", ["big", "small", "red"])]
)
def test_select_takes_the_choice_with_the_best_normalized_logprob(
    frontend, engine, model, prefix, choices
):
    assert not prefix.endswith(prefix[-2])  # no token healing (see the reference)
    decision, scores = frontend(programs.select, engine, prefix, choices)
    expected = [normalized_prompt_logprob(model, prefix, c) for c in choices]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert decision == choices[max(range(len(choices)), key=expected.__getitem__)]


def test_server_info_satisfies_sglangs_contract(frontend, engine):
    """/server_info as SGLang's frontend fetches it, decoded by sglang.api.v1's
    GetServerInfoResponse (which rejects a field of the wrong type)."""
    info = frontend(programs.server_info, engine)
    assert info["version"].startswith("moerl ")
    assert info["max_context_length"] == 128
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 64
