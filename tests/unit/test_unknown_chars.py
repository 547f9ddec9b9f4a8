"""Issue 31: characters outside the tiny tokenizer became <unk> with no word said."""

from __future__ import annotations

import logging

import numpy as np

from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.tasks.indexed import encode_prompt


def test_unknown_characters_are_named_once(caplog):
    tokenizer = build_tiny_tokenizer()
    with caplog.at_level(logging.WARNING, logger="moerl.tasks.indexed"):
        ids = encode_prompt(tokenizer, "2+2=4")  # all known: no word
        assert not caplog.records
        lossy = encode_prompt(tokenizer, "Caf\u00e9 2+2")  # 'C' and '\u00e9' are not in it
        encode_prompt(tokenizer, "\u00e9t\u00e9")  # the same tokenizer: said once
    assert tokenizer.unk_token_id not in ids
    assert int(np.sum(lossy == tokenizer.unk_token_id)) == 2
    (record,) = caplog.records
    assert "'C'" in record.getMessage() and "'\u00e9'" in record.getMessage()
    assert "model.path" in record.getMessage()
