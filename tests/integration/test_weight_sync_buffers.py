"""Bucketed weight sync through reused buffers, two buckets in flight: the engine's
weights equal what the trainer pushed, bit for bit, however many times the trainer's
staging buffers and the engine's receive buffers are reused."""

from __future__ import annotations

import pytest
import torch
from engine_http import InProcessEngine, checkpoint_tensors

from moerl.sync.weights import WeightSync, WeightSyncError


@pytest.fixture(scope="module")
def engine(own_engine: InProcessEngine) -> InProcessEngine:
    return own_engine


@pytest.fixture(scope="module")
def hf(tiny_checkpoints) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(tiny_checkpoints["qwen3_moe"])


def _random_like(hf: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in hf.items()}


def _engine_tensor(engine: InProcessEngine, name: str) -> torch.Tensor:
    tensor, index = engine.state.runner._target(name)
    return tensor[index] if index else tensor


def _assert_engine_holds(engine: InProcessEngine, want: dict[str, torch.Tensor]) -> None:
    differ = [n for n, t in want.items() if not torch.equal(_engine_tensor(engine, n), t)]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


def test_many_small_buckets_land_exactly_and_reuse_their_buffers(engine, hf):
    """Buckets of 8 KiB: most hold several tensors, the larger tensors go alone; each
    push reuses the same two staging buffers, and the engine its two receive buffers."""
    with WeightSync([], None, urls=[engine.url], bucket_mb=8 / 1024) as sync:
        for seed in (1, 2, 3):
            pushed = _random_like(hf, seed)
            stats = sync.push(seed, named=pushed.items())
            assert stats["buckets"] > 20 and stats["tensors"] == len(hf)
            _assert_engine_holds(engine, pushed)
            assert engine.state.scheduler.weight_version == str(seed)
            (staging,) = sync._staging.values()
            if seed == 1:
                first = [b.data_ptr() for b in staging._buffers]
            assert [b.data_ptr() for b in staging._buffers] == first and len(first) == 2


def test_a_cast_push_lands_as_the_cast_values(engine, hf):
    """dtype="bfloat16": each tensor is cast while it is gathered; the fp32 engine holds
    exactly the bf16 values."""
    pushed = _random_like(hf, 4)
    with WeightSync([], None, urls=[engine.url], bucket_mb=0.05, dtype="bfloat16") as sync:
        stats = sync.push(4, named=pushed.items())
    assert stats["bytes"] == sum(t.numel() * 2 for t in hf.values())
    _assert_engine_holds(engine, {k: v.bfloat16().float() for k, v in pushed.items()})


def test_a_bucket_refused_mid_push_leaves_the_group_usable(engine, hf):
    """An unknown name in a middle bucket (the next bucket already on the wire): the
    error names it, and the next push over the same group lands exactly."""
    pushed = list(_random_like(hf, 5).items())
    middle = len(pushed) // 2
    bad = [*pushed[:middle], ("model.nope.weight", torch.zeros(2)), *pushed[middle:]]
    with WeightSync([], None, urls=[engine.url], bucket_mb=8 / 1024) as sync:
        with pytest.raises(WeightSyncError, match="model.nope.weight"):
            sync.push(5, named=bad)
        good = _random_like(hf, 6)
        sync.push(6, named=good.items())
    _assert_engine_holds(engine, good)
    assert engine.state.scheduler.weight_version == "6"
