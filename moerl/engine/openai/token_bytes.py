"""A token's raw bytes for OpenAI logprobs (``bytes``), as SGLang 0.5.23's
``token_id_to_bytes``: byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) store each
token as printable stand-ins for its bytes, which a lone fragment of a multi-byte
character only shows as U+FFFD once decoded; the stand-ins give the bytes back. Other
tokenizers (SentencePiece, moerl's tiny character-level one) use the token text's UTF-8.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: stand-in character → byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = dict(zip(kept, kept))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token_id: int, text: str | None) -> list[int]:
    """The token's bytes: from its byte-level pieces when the tokenizer has them, else
    the UTF-8 of ``text`` (its decoded text)."""
    if tokenizer is not None and is_byte_level(tokenizer):
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        table = byte_decoder()
        if piece and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
    return list((text or "").encode())
