"""Shared fixtures: tiny HF checkpoints (no download) and embedded-engine servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from moerl.device import has_cuda
from moerl.engine.process import EngineProcess

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads this when a
# kernel is decorated (at import), so it is set before any test module imports one.
# The trainer's `auto` kernel backend still picks the torch twins on CPU tensors.
if not has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family → a tiny random HF checkpoint written with transformers' own classes."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("tiny-hf")
    return {
        f: save_tiny_checkpoint(tiny_config(f), root / f, seed=0)
        for f in ("deepseek_moe", "qwen3_moe")
    }


@pytest.fixture(scope="session")
def engine_factory() -> Iterator:
    started: list[EngineProcess] = []

    def start(model_path: Path, *extra: str, api_key: str | None = None) -> EngineProcess:
        eng = EngineProcess(model_path, *extra, api_key=api_key, threads=1)
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.close()


@pytest.fixture(scope="session")
def ds_engine(tiny_checkpoints, engine_factory) -> EngineProcess:
    """A DeepSeek-architecture engine with routed-experts capture on."""
    return engine_factory(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
