"""Adapters as a standard PEFT directory, and the merged-weights reference.

A PEFT LoRA directory is ``adapter_config.json`` plus ``adapter_model.safetensors``
with names ``base_model.model.<HF module>.lora_A.weight`` (A [r, in]) and
``….lora_B.weight`` (B [out, r]); the adapter adds (lora_alpha / r) · B A x. PEFT,
SGLang (``--lora-paths`` / ``/load_lora_adapter``) and moerl's engine read it.
``merged_hf_state`` folds an adapter into HF weights, W + scaling · B A: the model an
adapter-applying engine must reproduce.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from moerl.common.files import readable
from moerl.config.lora import LoraConfig
from moerl.config.model import ModelConfig
from moerl.lora.apply import resolve_targets
from moerl.lora.export import PEFT_PREFIX

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(
    cfg: LoraConfig, model: ModelConfig, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of adapters trained with ``cfg`` on ``model``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": resolve_targets(cfg, model),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def scaling_of(config: dict[str, Any]) -> float:
    """The factor PEFT multiplies B A by for this adapter config."""
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def save_peft(
    directory: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    """Write a PEFT adapter directory (created if needed); returns it."""
    from safetensors.torch import save_file

    bad = sorted(n for n in tensors if not n.startswith(PEFT_PREFIX) or ".lora_" not in n)
    if bad:
        raise ValueError(f"not PEFT LoRA tensor names: {bad[:3]}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {n: t.detach().cpu().contiguous() for n, t in sorted(tensors.items())}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    readable(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def load_peft(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter config) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"{directory} is not a PEFT adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type={config.get('peft_type')!r}, expected 'LORA'")
    return load_file(str(weights_path)), config


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name → (A, B) of PEFT-named tensors; raises on an unpaired tensor."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        body = name.removeprefix(PEFT_PREFIX)
        for which in ("A", "B"):
            suffix = f".lora_{which}.weight"
            if body.endswith(suffix):
                pairs.setdefault(body[: -len(suffix)], {})[which] = tensor
                break
        else:
            raise ValueError(f"{name!r} is not a PEFT LoRA tensor name")
    lone = sorted(m for m, p in pairs.items() if set(p) != {"A", "B"})
    if lone:
        raise ValueError(f"modules with only one of lora_A / lora_B: {lone[:5]}")
    return {m: (p["A"], p["B"]) for m, p in sorted(pairs.items())}


def merged_hf_state(
    base: str | Path | dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """Every tensor of ``base`` (an HF checkpoint directory or its tensors), with each
    adapted weight W replaced by W + scaling · B A (computed in fp32, cast back)."""
    if isinstance(base, dict):
        state = dict(base)
    else:
        from moerl.convert.hf_io import HFCheckpoint

        ckpt = HFCheckpoint(base)
        state = {name: ckpt.get(name) for name in sorted(ckpt.names())}
    scaling = scaling_of(config)
    for module, (a, b) in adapter_pairs(tensors).items():
        key = f"{module}.weight"
        if key not in state:
            raise KeyError(f"the base model has no weight {key!r} for the adapter's {module}")
        w = state[key]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(
                f"{module}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit W {tuple(w.shape)}"
            )
        state[key] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return state
