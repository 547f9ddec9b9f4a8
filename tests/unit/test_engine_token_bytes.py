"""OpenAI logprobs' token ``bytes``: a byte-level BPE tokenizer's fragments of a
multi-byte character give back their raw bytes (their decoded text is only U+FFFD);
a character-level tokenizer gives its token text's UTF-8."""

from __future__ import annotations

from moerl.engine.openai.token_bytes import byte_decoder, is_byte_level, token_bytes
from moerl.models.tokenizer import build_tiny_tokenizer


def _byte_level_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    core = ByteLevelBPETokenizer()
    core.train_from_iterator(["héllo wörld 日本語 hello world"] * 10, vocab_size=300)
    return PreTrainedTokenizerFast(tokenizer_object=core._tokenizer)


def test_byte_decoder_covers_every_byte_once():
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ")


def test_byte_level_fragments_give_their_raw_bytes():
    tok = _byte_level_tokenizer()
    assert is_byte_level(tok)
    ids = tok("日本 héllo", add_special_tokens=False).input_ids
    texts = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in texts)  # fragments: their text alone loses bytes
    got = b"".join(bytes(token_bytes(tok, i, t)) for i, t in zip(ids, texts))
    assert got == "日本 héllo".encode()


def test_other_tokenizers_give_the_texts_utf8():
    tok = build_tiny_tokenizer()
    assert not is_byte_level(tok)
    assert token_bytes(tok, 10, "a") == [97] and token_bytes(None, 3, None) == []
