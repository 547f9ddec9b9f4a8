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


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path):
    """Issue 31: a custom chat template had no config key (only the on/off switch)."""
    import pytest

    from moerl.config.task import CopyDigitsTaskConfig
    from moerl.tasks.registry import build_task

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}({{ m.content }}){% endfor %}:")
    tokenizer = build_tiny_tokenizer()
    cfg = CopyDigitsTaskConfig(chat_template=True, chat_template_file=str(template))
    cfg.validate("task")
    prompt = next(build_task(cfg, tokenizer).prompts(0))
    text = tokenizer.decode(prompt.input_ids, skip_special_tokens=True)
    assert text.startswith("(") and text.endswith("):")  # the file's template, not the tiny one
    with pytest.raises(ValueError, match="chat_template=true"):
        CopyDigitsTaskConfig(chat_template_file=str(template)).validate("task")
    with pytest.raises(ValueError, match="is not a file"):
        CopyDigitsTaskConfig(chat_template=True, chat_template_file="/nope.jinja").validate("task")
