"""moerl/engine/core/model_runner.py ``load_bucket``: a pushed bucket lands in the model as
transformers' own loading of the same tensors from a checkpoint puts them (per-expert
names into fused experts included), is refused whole before any write, and its cached
targets follow the release and resume of the weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moerl.engine.core.model_runner import ModelRunner


@pytest.fixture
def named(tiny_checkpoints):  # type: ignore[no-untyped-def]
    (path,) = tiny_checkpoints["qwen3_moe"].glob("*.safetensors")
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in load_file(path).items()}


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in runner.model.state_dict().items()}


def _loaded_by_transformers(src: Path, tensors: dict[str, torch.Tensor], out: Path) -> ModelRunner:
    """The reference: a runner built from a copy of ``src`` whose weights are ``tensors``
    (transformers reads and fuses them)."""
    shutil.copytree(src, out)
    (weights,) = out.glob("*.safetensors")
    save_file(tensors, str(weights))
    return ModelRunner(out)


def test_a_bucket_loads_as_transformers_loads_the_checkpoint(tiny_checkpoints, named, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoints["qwen3_moe"]
    bucket = ModelRunner(src)
    names, tensors = list(named), list(named.values())
    assert any(".experts." in n for n in names)  # per-expert names into fused tensors
    for round_ in range(2):  # the second round reads the cached targets
        scaled = [t * (round_ + 1) for t in tensors]
        assert bucket.load_bucket(names, [t.shape for t in scaled], scaled) == len(names)
        want = _state(
            _loaded_by_transformers(src, dict(zip(names, scaled)), tmp_path / f"{round_}")
        )
        got = _state(bucket)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_refused_bucket_changes_nothing(tiny_checkpoints, named):  # type: ignore[no-untyped-def]
    runner = ModelRunner(tiny_checkpoints["qwen3_moe"])
    before = _state(runner)
    names, tensors = list(named), list(named.values())
    shapes = [list(t.shape) for t in tensors]
    shapes[-1] = [s + 1 for s in shapes[-1]]
    with pytest.raises(ValueError, match=names[-1]):
        runner.load_bucket(names, shapes, tensors)
    with pytest.raises(ValueError, match="no tensor for 'model.nope'"):
        runner.load_bucket([*names, "model.nope"], [t.shape for t in tensors] + [[1]], tensors)
    after = _state(runner)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_cached_targets_follow_a_release_and_resume(tiny_checkpoints, named, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoints["qwen3_moe"]
    runner = ModelRunner(src)
    names, tensors = list(named), list(named.values())
    shapes = [t.shape for t in tensors]
    runner.load_bucket(names, shapes, tensors)  # targets cached: views of this memory
    runner.resume_weights(runner.release_weights())  # new memory, zeros
    runner.load_bucket(names, shapes, tensors)
    got, want = _state(runner), _state(_loaded_by_transformers(src, named, tmp_path / "ref"))
    assert all(torch.equal(got[k], want[k]) for k in want)
