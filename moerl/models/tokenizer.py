"""Tokenizers: the checkpoint's own HF tokenizer for real models (local files only),
and a built-in character-level tokenizer for tiny models, so nothing downloads.

The built-in vocabulary covers digits, arithmetic signs, lowercase letters and
punctuation, which is what moerl's synthetic tasks need, and JSON's brackets and quotes
(for constrained decoding tests). Its chat template writes each message as
``role: content `` and the generation prompt as ``assistant: `` (only characters of the
vocabulary), so ``/v1/chat/completions`` runs on the tiny checkpoints; tool definitions
are not rendered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] + ': ' + (message['content'] or '') + ' ' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
)
CHARS = list("0123456789+-*/=()., :?") + list("abcdefghijklmnopqrstuvwxyz") + list('{}[]"_')


def build_tiny_tokenizer(vocab_size: int = 128) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character (ids < vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    if len(vocab) > vocab_size:
        raise ValueError(f"the built-in tokenizer needs vocab_size >= {len(vocab)}")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer saved in a local checkpoint directory (never downloads)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
            "copy the tokenizer into the checkpoint directory"
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
