"""Build a random HF checkpoint of a family with transformers' own model classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moerl.config.model import ModelConfig
from moerl.models.registry import get_family
from moerl.models.tokenizer import build_tiny_tokenizer


def special_token_ids(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's bos/eos/pad ids under their config names, so config.json and
    generation_config.json stop where the tokenizer's EOS says (and nowhere else)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def build_hf_model(model: ModelConfig, seed: int = 0) -> Any:
    """An fp32 transformers model for ``model`` with random weights (incl. expert bias)
    and the built-in tokenizer's special token ids."""
    import transformers

    family = get_family(model.family)
    tokens = special_token_ids(build_tiny_tokenizer(model.vocab_size))
    config = transformers.AutoConfig.for_model(**family.to_hf(model), **tokens)
    torch.manual_seed(seed)
    hf_model = family.hf_model_class()(config).float().eval()
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))  # make the bias matter in routing
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))  # non-trivial norms
    return hf_model


def save_tiny_checkpoint(
    model: ModelConfig, out: str | Path, seed: int = 0, bf16_values: bool = False
) -> Path:
    """Write config.json, generation_config.json, safetensors and tokenizer files for a
    random model; both configs carry the tokenizer's bos/eos/pad ids. ``bf16_values``: the
    fp32 weights rounded to bf16 values (so a tensor transformers keeps in fp32 in a bf16
    model, such as DeepSeek's router, holds what a bf16 trainer holds)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_model = build_hf_model(model, seed)
    if bf16_values:
        with torch.no_grad():
            for tensor in hf_model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(tensor.bfloat16())
    hf_model.save_pretrained(str(out), safe_serialization=True)
    build_tiny_tokenizer(model.vocab_size).save_pretrained(str(out))
    return out
