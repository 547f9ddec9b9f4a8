"""A checkpoint directory with moerl's tiny DeepSeek config.json, for start-up checks
(tests/unit/test_preflight.py, tests/integration/test_launch_cli.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.models import get_family
from moerl.models.tiny import tiny_config


def hf_dir(path: Path, **changes: object) -> Path:
    """A checkpoint directory whose config.json is moerl's tiny DeepSeek with `changes`
    (the weights file only needs a valid header: preflight reads no tensor)."""
    model = dataclasses.replace(tiny_config("deepseek_moe"), **changes)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(get_family("deepseek_moe").to_hf(model)))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    return path
