"""The engine's EOS ids: the union of the model config's, generation_config.json's and the
tokenizer's, as SGLang 0.5.23 stops on them (sglang/srt/configs/model_config.py
``_get_hf_eos_token_id`` plus the tokenizer's eos and additional stop ids)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moerl.engine.core.eos import eos_token_ids
from moerl.models.tokenizer import build_tiny_tokenizer

TOKENIZER_EOS = 2  # "<eos>" of the built-in tokenizer


def _dir(tmp_path, generation_eos=None, write=True):  # type: ignore[no-untyped-def]
    if write:
        body = {} if generation_eos is None else {"eos_token_id": generation_eos}
        (tmp_path / "generation_config.json").write_text(json.dumps(body))
    return tmp_path


@pytest.mark.parametrize(
    "config_eos, generation_eos, write, expected",
    [
        (7, None, False, {7, TOKENIZER_EOS}),  # no generation_config.json
        (7, None, True, {7, TOKENIZER_EOS}),  # the file without eos_token_id
        (7, 9, True, {7, 9, TOKENIZER_EOS}),
        ([7, 8], [9, 10], True, {7, 8, 9, 10, TOKENIZER_EOS}),
        (None, 9, True, {9, TOKENIZER_EOS}),
        (None, None, False, {TOKENIZER_EOS}),
        (TOKENIZER_EOS, TOKENIZER_EOS, True, {TOKENIZER_EOS}),
        # SGLang tests generation_config's value for truth: 0 and [] add nothing there,
        # while the model config's 0 counts.
        (7, 0, True, {7, TOKENIZER_EOS}),
        (7, [], True, {7, TOKENIZER_EOS}),
        (0, None, False, {0, TOKENIZER_EOS}),
    ],
)
def test_union_of_config_generation_config_and_tokenizer(
    tmp_path, config_eos, generation_eos, write, expected
):
    path = _dir(tmp_path, generation_eos, write)
    config = SimpleNamespace(eos_token_id=config_eos)
    assert eos_token_ids(path, config, build_tiny_tokenizer()) == sorted(expected)


def test_without_a_tokenizer_only_the_configs_count(tmp_path):
    path = _dir(tmp_path, [9, 10])
    assert eos_token_ids(path, SimpleNamespace(eos_token_id=7), None) == [7, 9, 10]
    assert eos_token_ids(path, SimpleNamespace(), None) == [9, 10]  # no eos_token_id at all


def test_additional_stop_tokens_of_the_tokenizer_count(tmp_path):
    """SGLang's attach_additional_stop_token_ids: turn-end markers in the added vocab."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eom_id|>", "<|other|>"]})
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    got = eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=7), tokenizer)
    assert got == sorted({7, TOKENIZER_EOS, eom})
    assert tokenizer.convert_tokens_to_ids("<|other|>") not in got


def test_a_malformed_generation_config_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json is not a JSON object"):
        eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=7))
