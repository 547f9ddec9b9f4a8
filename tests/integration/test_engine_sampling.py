"""Issue 16, items 4 and 10: SGLang 0.5.23's whole sampling-parameter set, top and
input-token logprobs, and batch requests, served by a real engine process.

The reference for every number is transformers' model run on the whole sequence at each
step (no KV cache, no engine code) with SGLang's penalty formulas written out here."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import httpx
import pytest
import torch

PROMPT = [5, 6, 7, 8]

# What SGLang's frontend sends with every sgl.gen, defaults included (sglang/lang/ir.py).
FRONTEND_DEFAULTS = {
    "max_new_tokens": 4,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "stop_regex": [],
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 1 << 30,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "regex": None,
    "json_schema": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "custom_params": None,
    "repetition_penalty": 1.0,
    "beam_width": None,
    "ebnf": None,
    "structural_tag": None,
    "watermark": None,
}


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["qwen3_moe"]
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from moerl.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoints["qwen3_moe"])


@torch.no_grad()
def last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].double()


def reference_greedy(model, prompt, steps, rep=1.0, freq=0.0, pres=0.0):
    """Greedy tokens and their logprobs with SGLang's penalties over generated tokens."""
    ids, out, logprobs, counts = list(prompt), [], [], Counter()
    for _ in range(steps):
        z = last_logits(model, ids)
        for t, c in counts.items():
            if rep != 1.0:
                z[t] = z[t] * rep if z[t] < 0 else z[t] / rep
            z[t] -= freq * c + pres
        t = int(z.argmax())
        logprobs.append(float(torch.log_softmax(z, -1)[t]))
        out.append(t)
        ids.append(t)
        counts[t] += 1
    return out, logprobs


def gen(http, input_ids=PROMPT, **sampling):
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, **sampling}}
    r = http.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_sglang_field_at_its_default_is_served(http):
    r = http.post("/generate", {"text": "ab", "sampling_params": FRONTEND_DEFAULTS})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 4


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"sampling_params": {"beam_width": 2}}, "beam_width"),
        ({"sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
        ({"sampling_params": {"watermark": {"enabled": True}}}, "watermark"),
        ({"custom_logit_processor": "x"}, "custom_logit_processor"),
        ({"sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
        ({"sampling_params": {"logit_bias": {"999999": 1.0}}}, "logit_bias"),
        ({"sampling_params": {"stop_regex": "("}}, "stop_regex"),
        ({"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "only one"),
        ({"return_logprob": True, "logprob_start_len": 4}, "logprob_start_len"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(http, extra, words):
    body = {"input_ids": PROMPT, **extra}
    r = http.post("/generate", body)
    assert r.status_code == 400, r.text
    assert words in r.text


def test_penalties_follow_sglang_formulas(http, model):
    steps = 10
    plain, _ = reference_greedy(model, PROMPT, steps)
    want, want_lp = reference_greedy(model, PROMPT, steps, rep=1.7, freq=0.6, pres=0.4)
    assert want != plain  # the penalties change this greedy sequence
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": steps,
            "ignore_eos": True,
            "repetition_penalty": 1.7,
            "frequency_penalty": 0.6,
            "presence_penalty": 0.4,
        },
    }
    out = http.post("/generate", body).json()
    assert out["output_ids"] == want
    got = out["meta_info"]["output_token_logprobs"]
    assert [row[1] for row in got] == want
    assert [row[0] for row in got] == pytest.approx(want_lp, abs=1e-4)


def test_min_new_tokens_holds_back_stop_ids_and_the_mask_shows_it(http, model):
    first = int(last_logits(model, PROMPT).argmax())
    r = http.post(
        "/generate",
        {
            "input_ids": PROMPT,
            "return_sampling_mask": True,
            "sampling_params": {
                "temperature": 0.7,
                "top_k": 5,
                "max_new_tokens": 6,
                "min_new_tokens": 3,
                "stop_token_ids": [first],
                "sampling_seed": 1,
            },
        },
    ).json()
    masks = r["meta_info"]["output_token_sampling_mask"]
    assert all(first not in m for m in masks[:3])
    assert first not in r["output_ids"][:3]
    plain = gen(http, max_new_tokens=3, stop_token_ids=[first])
    assert plain["output_ids"] == [first]  # without min_new_tokens it stops at once
    assert plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_logit_bias_moves_the_choice(http, model):
    z = last_logits(model, PROMPT)
    target = int(z.argsort()[len(z) // 2])  # a token greedy would not pick
    out = gen(http, max_new_tokens=3, ignore_eos=True, logit_bias={str(target): 100.0})
    assert out["output_ids"] == [target] * 3


def test_ignore_eos_also_ignores_stop_token_ids_as_sglang(http, model):
    first = int(last_logits(model, PROMPT).argmax())
    out = gen(http, max_new_tokens=4, stop_token_ids=[first], ignore_eos=True)
    assert len(out["output_ids"]) == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


# The tiny model's vocabulary is wider than its character tokenizer: a bias keeps greedy
# decoding on the characters, so the output has text.
CHARS = {"logit_bias": {str(i): 50.0 for i in range(4, 52)}, "ignore_eos": True}  # 0-9 a-z ...


def _free_text(http, tokenizer):
    """A greedy continuation of printable characters."""
    out = gen(http, max_new_tokens=12, **CHARS)
    text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    return out, text


def test_stop_strings_cut_the_text_unless_no_stop_trim(http, tokenizer):
    out, text = _free_text(http, tokenizer)
    assert len(text) >= 4, text
    stop = text[2:4]
    pos = text.find(stop)
    cut = gen(http, max_new_tokens=12, **CHARS, stop=[stop, "unused"])
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:pos]
    assert cut["output_ids"] == out["output_ids"][: len(cut["output_ids"])]
    kept = gen(http, max_new_tokens=12, **CHARS, stop=stop, no_stop_trim=True)
    assert kept["text"] == text[: pos + len(stop)]


def test_stop_regex_stops_where_the_pattern_first_matches(http, tokenizer):
    out, text = _free_text(http, tokenizer)
    pattern = re.escape(text[3]) + "$"
    r = gen(http, max_new_tokens=12, **CHARS, stop_regex=pattern)
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    n = len(r["output_ids"])
    assert tokenizer.decode(r["output_ids"]).endswith(text[3])
    assert text[3] not in tokenizer.decode(out["output_ids"][: n - 1])


def test_skip_special_tokens(http, tokenizer):
    pad = tokenizer.pad_token_id
    body = {"max_new_tokens": 2, "ignore_eos": True, "logit_bias": {str(pad): 100.0}}
    assert gen(http, **body)["text"] == ""
    shown = gen(http, **body, skip_special_tokens=False)["text"]
    assert shown == tokenizer.decode([pad, pad])
    assert tokenizer.pad_token in shown


def test_the_eos_is_trimmed_from_the_text(http, tokenizer):
    """A matched stop token is cut from the text (SGLang's trim_matched_stop)."""
    token = tokenizer.convert_tokens_to_ids("a")
    body = {"max_new_tokens": 3, "logit_bias": {str(token): 100.0}, "stop_token_ids": [token]}
    out = gen(http, **body, skip_special_tokens=False)
    assert out["output_ids"] == [token] and out["text"] == ""
    assert gen(http, **body, no_stop_trim=True)["text"] == "a"


def test_sampling_seed_makes_sampling_repeatable(http):
    def sampled(seed):
        body = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
        return gen(http, **body, sampling_seed=seed)["output_ids"]

    assert sampled(7) == sampled(7)
    assert len({tuple(sampled(s)) for s in (1, 2, 3, 4)}) > 1


def test_stream_interval_sets_the_chunk_size(http):
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "stream_interval": 3},
    }
    events = _events(http, body)
    assert [len(e["output_ids"]) for e in events] == [3, 6, 7]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def _events(http, body):
    with httpx.stream(
        "POST", f"{http.url}/generate", json=body, headers=http.headers, timeout=30
    ) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_top_logprobs_and_input_logprobs_match_the_model(http, model, tokenizer):
    prompt = [5, 6, 7, 8, 9, 10]
    r = http.post(
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 3,
            "token_ids_logprob": [4, 9],
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        },
    ).json()
    meta = r["meta_info"]
    with torch.no_grad():
        full = model(torch.tensor([prompt + r["output_ids"]])).logits[0].double()
    lp = torch.log_softmax(full, -1)
    # input: positions 1..5, the first without a value (SGLang's None)
    rows = meta["input_token_logprobs"]
    assert [row[1] for row in rows] == prompt[1:]
    assert rows[0][0] is None
    assert [row[0] for row in rows[1:]] == pytest.approx(
        [float(lp[p - 1, prompt[p]]) for p in range(2, len(prompt))], abs=1e-4
    )
    assert rows[1][2] == tokenizer.decode([prompt[2]])
    top_in = meta["input_top_logprobs"]
    assert top_in[0] is None and len(top_in) == len(prompt) - 1
    for p, row in zip(range(1, len(prompt) - 1), top_in[1:]):
        values, ids = lp[p].topk(3)
        assert [x[1] for x in row] == ids.tolist()
        assert [x[0] for x in row] == pytest.approx(values.tolist(), abs=1e-4)
    # output: top 3 and the asked ids at each generated position
    for k, (row, ids_row) in enumerate(
        zip(meta["output_top_logprobs"], meta["output_token_ids_logprobs"])
    ):
        pos = len(prompt) - 1 + k
        values, ids = lp[pos].topk(3)
        assert [x[1] for x in row] == ids.tolist()
        assert [x[0] for x in row] == pytest.approx(values.tolist(), abs=1e-4)
        assert [x[1] for x in ids_row] == [4, 9]
        assert [x[0] for x in ids_row] == pytest.approx(
            [float(lp[pos, 4]), float(lp[pos, 9])], abs=1e-4
        )
    assert meta["output_token_logprobs"][0][1] == meta["output_top_logprobs"][0][0][1]


def test_input_logprobs_without_generation(http, model):
    """sgl.select's call: max_new_tokens 0, logprobs of the prompt from a start."""
    prompt = [5, 6, 7, 8]
    r = http.post(
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        },
    ).json()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    rows = r["meta_info"]["input_token_logprobs"]
    assert r["output_ids"] == [] and rows[0] == [None, 5, None]
    want = [float(lp[p - 1, prompt[p]]) for p in range(1, 4)]
    assert [row[0] for row in rows[1:]] == pytest.approx(want, abs=1e-4)
    default = http.post("/generate", {"input_ids": prompt, "return_logprob": True}).json()
    assert default["meta_info"]["input_token_logprobs"] == [[None, 8, None]]


def test_a_batch_is_answered_with_a_list(http, tokenizer):
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    alone = [gen(http, p, max_new_tokens=3, ignore_eos=True)["output_ids"] for p in prompts]
    r = http.post(
        "/generate",
        {
            "input_ids": prompts,
            "rid": ["a", "b", "c"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        },
    )
    out = r.json()
    assert isinstance(out, list) and [o["output_ids"] for o in out] == alone
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    # per-item sampling params, text prompts, a batch of one stays a list
    per_item = http.post(
        "/generate",
        {
            "text": ["ab", "cd"],
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
                {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
            ],
        },
    ).json()
    assert [o["meta_info"]["completion_tokens"] for o in per_item] == [1, 2]
    assert per_item[0]["meta_info"]["prompt_tokens"] == len(tokenizer("ab").input_ids)
    one = http.post("/generate", {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 1}})
    assert isinstance(one.json(), list) and len(one.json()) == 1
    bad = http.post("/generate", {"input_ids": prompts, "rid": ["a", "b"]})
    assert bad.status_code == 400 and "rid" in bad.text


def test_a_batch_streams_with_indices(http):
    prompts = [[5, 6, 7], [9, 10]]
    body = {
        "input_ids": prompts,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
    }
    events = _events(http, body)
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    alone = [gen(http, p, max_new_tokens=3, ignore_eos=True)["output_ids"] for p in prompts]
    assert [finals[i]["output_ids"] for i in (0, 1)] == alone
    assert len(events) == 6  # three tokens each, the last one final


def test_logprobs_are_finite_under_a_grammar_free_bias(http):
    """-inf logits (a huge negative bias) are reported as finite numbers, as SGLang."""
    r = http.post(
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "top_logprobs_num": 128,
            "sampling_params": {"max_new_tokens": 1, "logit_bias": {"3": -1e30}},
        },
    ).json()
    values = [row[0] for row in r["meta_info"]["output_top_logprobs"][0]]
    assert all(math.isfinite(v) for v in values)
