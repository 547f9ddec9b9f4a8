"""moerl/engine/validate.py ``nonfinite_tensor`` on tensors larger than its check's chunk:
a NaN or ±inf anywhere (first chunk, a middle one, the ragged last one) is found, in
every float dtype, against torch's own ``isfinite`` as the reference."""

from __future__ import annotations

import pytest
import torch

from moerl.engine.validate import _CHUNK, nonfinite_tensor


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_a_bad_value_anywhere_in_a_large_tensor_is_found(dtype):
    numel = 3 * _CHUNK + 123  # three whole chunks and a ragged one
    gen = torch.Generator().manual_seed(0)
    fine = torch.randn(numel, generator=gen).to(dtype).reshape(-1, 1)
    assert bool(torch.isfinite(fine).all()) and nonfinite_tensor([("w", fine)]) is None
    for where in (0, _CHUNK + 7, 2 * _CHUNK - 1, numel - 1):
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = fine.clone()
            t.view(-1)[where] = bad
            assert not bool(torch.isfinite(t).all())
            assert nonfinite_tensor([("ok", fine), ("bad", t)]) == "bad", (where, bad)


def test_a_strided_tensor_is_checked_too():
    t = torch.randn(4 * _CHUNK // 256, 256)
    view = t.t()  # not contiguous: the torch path
    assert nonfinite_tensor([("t", view)]) is None
    t[3, 5] = float("nan")
    assert nonfinite_tensor([("t", view)]) == "t"
