"""Constrained decoding for the engine: SGLang's ``regex``, ``json_schema`` and ``ebnf``
through llguidance (one of SGLang's own grammar backends).

``GrammarBackend.check`` compiles a request's grammar on the server thread, so a bad one
is a 400 before the request is queued; ``GrammarBackend.matcher`` gives each sequence its
own ``GrammarMatcher``, which the sampler asks for the allowed tokens at every step (they
are folded into the recorded sampling mask) and tells which token was sampled.

End of a grammar, as SGLang's xgrammar backend behaves: once the grammar is complete, the
only allowed token is EOS, so the request stops on EOS; with ``ignore_eos`` the EOS is
accepted by the grammar and ``done`` becomes true, which finishes the request too.

``ebnf`` is SGLang's (xgrammar's) GBNF dialect, turned into llguidance's Lark dialect by
llguidance's own converter. Tokenizers llguidance cannot read directly (its Hugging Face
reader knows byte-level and metaspace decoders) are described to it token by token, which
is exact for tokenizers whose tokens decode independently, as the tiny models' one does.
"""

# V vocabulary (the model's logits width)

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

KINDS = ("regex", "json_schema", "ebnf")
CACHE_SIZE = 256  # compiled grammars kept


class GrammarBackend:
    """Compiles grammars against one tokenizer; ids past the tokenizer's vocabulary (the
    model's logits may be wider) are never allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError("grammars need a tokenizer in the model directory")
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise ValueError(
                "constrained decoding needs llguidance: pip install llguidance"
            ) from None
        self.vocab_size = vocab_size
        self.tokenizer = _ll_tokenizer(tokenizer)
        self.eos = set(self.tokenizer.eos_tokens)
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # check() runs on the server thread, matcher() too

    def check(self, kind: str, source: str) -> None:
        """ValueError naming ``sampling_params.<kind>`` if the grammar does not compile."""
        self._compiled(kind, source)

    def matcher(self, kind: str, source: str) -> GrammarMatcher:
        from llguidance import LLMatcher

        grammar = self._compiled(kind, source)
        return GrammarMatcher(LLMatcher(self.tokenizer, grammar), self.vocab_size, self.eos)

    def _compiled(self, kind: str, source: str) -> str:
        key = (kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._compile(kind, source)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, kind: str, source: str) -> str:
        from llguidance import LLMatcher

        field = f"sampling_params.{kind}"
        try:
            if kind == "regex":
                grammar = LLMatcher.grammar_from_regex(source)
            elif kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(source)
            elif kind == "ebnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(source))
            else:
                raise ValueError(f"unknown grammar kind {kind!r}: choose one of {KINDS}")
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
        except Exception as err:  # the converters raise their own types on bad input
            raise ValueError(f"{field}: {type(err).__name__}: {err}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"{field}: {messages[0].strip()[:500]}")
        return grammar


class GrammarMatcher:
    """One sequence's grammar state (used on the scheduler thread only)."""

    def __init__(self, matcher: Any, vocab_size: int, eos: set[int]) -> None:
        self._m = matcher
        self._vocab_size = vocab_size
        self._eos = eos
        self._ended = False  # an EOS was accepted at the grammar's end
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()[:500]}")

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (only EOS once it is complete)."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), np.uint8), bitorder="little")
        out = torch.zeros(self._vocab_size, dtype=torch.bool)
        n = min(len(bits), self._vocab_size)
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def accept(self, token: int) -> None:
        """Advance by the sampled token; ValueError if the grammar forbids it."""
        if not self._m.consume_token(token):
            raise ValueError(f"grammar: token {token} is not allowed: {self._m.get_error()[:300]}")
        self._ended = token in self._eos and self._m.is_stopped()

    @property
    def done(self) -> bool:
        return self._ended


def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for an HF tokenizer: its own reader where it can, else a
    token-by-token description (each id's decoded bytes; special tokens marked)."""
    import llguidance.hf
    from llguidance import LLTokenizer, TokenizerWrapper

    try:
        return llguidance.hf.from_tokenizer(tokenizer)
    except ValueError:
        return LLTokenizer(TokenizerWrapper(_TokenTable(tokenizer)))


class _TokenTable:
    """What llguidance's ``TokenizerWrapper`` reads: per-id bytes, EOS/BOS, specials, and
    a call that tokenizes text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids))
        special = set(self.special_token_ids)
        self.tokens = [
            b"\xff" + str(tokenizer.convert_ids_to_tokens(i)).encode()
            if i in special
            else str(tokenizer.decode([i])).encode()
            for i in range(len(tokenizer))
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))
