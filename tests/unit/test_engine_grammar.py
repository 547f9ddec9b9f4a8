"""moerl.engine.core.grammar on the tiny models' tokenizer with the real llguidance: what a
grammar allows, step by step, against brute force over the vocabulary and Python's own
``re`` and ``json``."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from moerl.engine.core.grammar import GrammarBackend
from moerl.models.tokenizer import build_tiny_tokenizer

VOCAB = 128  # the model's logits are wider than the tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, VOCAB)


def walk(backend, tokenizer, kind, source, seed, limit=80):
    """Choose random allowed tokens until the grammar ends on EOS; the text and ids."""
    matcher, rng, ids = backend.matcher(kind, source), random.Random(seed), []
    while not matcher.done and len(ids) < limit:
        allowed = torch.nonzero(matcher.allowed()).flatten().tolist()
        assert allowed and max(allowed) < len(tokenizer)  # never past the tokenizer
        ids.append(rng.choice(allowed))
        matcher.accept(ids[-1])
    assert matcher.done and ids[-1] == tokenizer.eos_token_id
    return tokenizer.decode(ids[:-1]), ids


def test_the_first_allowed_tokens_equal_brute_force(backend, tokenizer):
    pattern = "[0-9]{3}"
    allowed = set(torch.nonzero(backend.matcher("regex", pattern).allowed()).flatten().tolist())
    # a token is allowed iff its text can start a match: re.fullmatch on text + a padding
    brute = {
        i
        for i in range(len(tokenizer))
        if i not in tokenizer.all_special_ids
        and (text := tokenizer.decode([i]))
        and any(re.fullmatch(pattern, text + pad) for pad in ("", "0", "00"))
    }
    assert allowed == brute and len(brute) == 10


@pytest.mark.parametrize("seed", range(5))
def test_regex_walks_fullmatch(backend, tokenizer, seed):
    pattern = "(ab|c)[0-9]{1,3}x?"
    text, _ = walk(backend, tokenizer, "regex", pattern, seed)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_walks_are_valid_json_of_the_schema(backend, tokenizer, seed):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    text, _ = walk(backend, tokenizer, "json_schema", json.dumps(schema), seed)
    value = json.loads(text)
    assert set(value) == {"a", "b"} and isinstance(value["a"], int)
    assert value["b"] in ("x", "yy")


def test_ebnf_allows_only_its_words(backend, tokenizer):
    words = {walk(backend, tokenizer, "ebnf", 'root ::= "yes" | "no"', s)[0] for s in range(8)}
    assert words == {"yes", "no"}


def test_complete_grammar_allows_only_eos_and_a_forbidden_token_raises(backend, tokenizer):
    matcher = backend.matcher("regex", "[0-9]{2}")
    with pytest.raises(ValueError, match="not allowed"):
        backend.matcher("regex", "[0-9]{2}").accept(tokenizer.convert_tokens_to_ids("a"))
    for ch in "42":
        matcher.accept(tokenizer.convert_tokens_to_ids(ch))
    assert torch.nonzero(matcher.allowed()).flatten().tolist() == [tokenizer.eos_token_id]
    assert not matcher.done
    matcher.accept(tokenizer.eos_token_id)
    assert matcher.done


@pytest.mark.parametrize(
    "kind, source",
    [("regex", "("), ("json_schema", "{"), ("json_schema", '{"type": "bogus"}'), ("ebnf", "x")],
)
def test_a_bad_grammar_names_its_field(backend, kind, source):
    with pytest.raises(ValueError, match=f"sampling_params.{kind}"):
        backend.check(kind, source)
