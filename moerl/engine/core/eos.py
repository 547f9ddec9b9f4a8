"""The token ids that end a generation, gathered from the same sources SGLang 0.5.23 uses.

SGLang stops a request (unless ``ignore_eos``) on any of:

- ``config.json``'s ``eos_token_id`` (an int or a list), its ``ModelConfig.hf_eos_token_id``;
- ``generation_config.json``'s ``eos_token_id`` (an int or a list) when the file exists,
  merged into the same set; as in SGLang, a falsy value there (``0``, ``[]``) adds nothing;
- the tokenizer's ``eos_token_id``;
- the tokenizer's ``additional_stop_token_ids``: the turn-end markers below when the
  tokenizer has them as added tokens (some checkpoints name only another token as EOS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SGLang's _ADDITIONAL_STOP_TOKEN_TEXTS: <|eom_id|> (Llama-3 tool use),
# <|content_model_end_sampling|> (Inkling), <|ifm|im_end|> (K2 Horizon).
ADDITIONAL_STOP_TOKENS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


def _ids(value: Any) -> set[int]:
    """An ``eos_token_id`` field (None, an int or a list of ints) as a set."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def generation_config_eos(model_path: str | Path) -> Any:
    """``generation_config.json``'s ``eos_token_id`` as written, or None without the file."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path} is not a JSON object: {err}") from None


def eos_token_ids(model_path: str | Path, config: Any, tokenizer: Any = None) -> list[int]:
    """Every id a generation stops on (sorted): the union of the model config's, the
    generation config's and the tokenizer's EOS ids, as SGLang stops on them."""
    ids = _ids(getattr(config, "eos_token_id", None))
    from_generation = generation_config_eos(model_path)
    if from_generation:  # SGLang's truthiness test: 0 and [] are skipped
        ids |= _ids(from_generation)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        added = tokenizer.get_added_vocab()
        ids |= {int(added[text]) for text in ADDITIONAL_STOP_TOKENS if text in added}
    return sorted(ids)
