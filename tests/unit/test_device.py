"""``moerl.device``'s device names: the spelling check config validation uses and the
resolution the engine's ``--device`` uses."""

from __future__ import annotations

import pytest
import torch

from moerl.device import check_device_name, resolve


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted(name):
    check_device_name("engine.device", name)


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "", None, 0])
def test_device_names_refused_with_the_choices(name):
    with pytest.raises(ValueError, match=r"engine.device=.* choose 'auto', 'cpu', 'cuda'"):
        check_device_name("engine.device", name)


def test_cpu_and_auto_resolve_on_this_machine():
    assert resolve("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve("auto").type == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_flag_and_the_fix(name):
    with pytest.raises(ValueError, match=rf"--device {name}: .* no CUDA device.*--device cpu"):
        resolve(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_that_does_not_exist_is_refused():
    count = torch.cuda.device_count()
    assert resolve("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=f"has {count} CUDA device"):
        resolve(f"cuda:{count}")
