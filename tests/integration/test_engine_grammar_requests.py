"""Issue 16: constrained decoding (``regex``, ``json_schema``, ``ebnf``) served by a real
engine process, with the grammar folded into the recorded sampling mask so that replaying
the mask keeps the importance ratio exact (checked against transformers' model)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["qwen3_moe"]
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from moerl.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoints["qwen3_moe"])


def generate(http, **extra):
    r = http.post("/generate", {"input_ids": PROMPT, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_output_matches_and_the_mask_replays_exactly(http, model, tokenizer, seed):
    pattern = "[0-9]{2,4}(ab|c)"
    temperature = 0.9
    out = generate(
        http,
        return_sampling_mask=True,
        sampling_params={
            "regex": pattern,
            "temperature": temperature,
            "top_k": 20,
            "max_new_tokens": 12,
            "sampling_seed": seed,
        },
    )
    ids, meta = out["output_ids"], out["meta_info"]
    assert ids[-1] == tokenizer.eos_token_id
    assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert re.fullmatch(pattern, out["text"]), out["text"]
    masks, sampling = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].double()
    for pos, (mask, logprob) in enumerate(zip(masks, sampling)):
        text_before = tokenizer.decode(ids[:pos])
        for token in mask:  # every kept token keeps the output a prefix of a match
            if token == tokenizer.eos_token_id:
                assert re.fullmatch(pattern, text_before)
            else:
                assert _prefix_can_match(pattern, text_before + tokenizer.decode([token]))
        # the trainer's view: the model's distribution renormalised over the mask
        kept = torch.log_softmax(logits[pos, mask] / temperature, -1)
        assert logprob == pytest.approx(float(kept[mask.index(ids[pos])]), abs=1e-4)


def _prefix_can_match(pattern: str, text: str) -> bool:
    """Brute force for this pattern's alphabet: some completion of <= 5 chars matches."""
    tails = ["", *"0123456789abc"]
    frontier = {text}
    for _ in range(5):
        if any(re.fullmatch(pattern, t) for t in frontier):
            return True
        frontier = {t + c for t in frontier for c in tails[1:]}
    return any(re.fullmatch(pattern, t) for t in frontier)


def test_json_schema_output_is_valid(http):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "w": {"enum": ["up", "down"]}},
        "required": ["n", "w"],
        "additionalProperties": False,
    }
    for seed in range(3):
        out = generate(
            http,
            sampling_params={
                "json_schema": json.dumps(schema),
                "temperature": 1.0,
                "max_new_tokens": 40,
                "sampling_seed": seed,
                # keep integers short: the random model would write digits for long
                "logit_bias": {"5": -8.0},
            },
        )
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue  # a long integer: a valid prefix, checked by the grammar tests
        value = json.loads(out["text"])
        assert set(value) == {"n", "w"} and value["w"] in ("up", "down")
        assert isinstance(value["n"], int)


def test_ebnf_and_parallel_samples_have_their_own_grammar_state(http):
    out = generate(
        http,
        sampling_params={
            "ebnf": 'root ::= "yes" | "no" | "maybe"',
            "temperature": 1.0,
            "n": 3,  # the robust engine queues at most 3
            "max_new_tokens": 8,
        },
    )
    assert isinstance(out, list) and len(out) == 3
    assert all(o["text"] in ("yes", "no", "maybe") for o in out), [o["text"] for o in out]


def test_greedy_regex_with_logprobs(http, model, tokenizer):
    out = generate(
        http,
        return_logprob=True,
        sampling_params={"regex": "[a-c]{3}", "temperature": 0, "max_new_tokens": 8},
    )
    assert re.fullmatch("[a-c]{3}", out["text"])
    allowed = [tokenizer.convert_tokens_to_ids(c) for c in "abc"]
    ids = out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 :].double()
    for pos in range(3):  # greedy among the grammar's tokens
        best = max(allowed, key=lambda t: float(logits[pos, t]))
        assert ids[pos] == best
    reported = out["meta_info"]["output_token_logprobs"][0][0]
    assert math.isfinite(reported) and reported <= 0


@pytest.mark.parametrize(
    "params, field",
    [
        ({"regex": "("}, "sampling_params.regex"),
        ({"json_schema": "{"}, "sampling_params.json_schema"),
        ({"ebnf": "nonsense"}, "sampling_params.ebnf"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_the_field(http, params, field):
    r = http.post("/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert r.status_code == 400 and field in r.text, r.text
