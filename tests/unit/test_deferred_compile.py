"""megatron-core's ``jit_fuser`` compiles on first call (moerl/common/deferred_compile.py):
importing megatron-core no longer imports torch's compiler, and a deferred function
computes what the function computes, compiled by torch.compile when first called."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moerl.common.deferred_compile import defer, set_eager

_PROBE = """
import sys
import moerl
import megatron.core
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
import torch
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo",
      getattr(jit.jit_fuser, "__qualname__", ""),
      getattr(fused_bias_swiglu.swiglu, "__moerl_deferred__", False))
x = torch.randn(4, 6)
y = fused_bias_swiglu.swiglu(x)  # the first call goes through torch.compile
a, b = torch.chunk(x, 2, -1)
print(torch.allclose(y, torch.nn.functional.silu(a) * b), "torch._dynamo" in sys.modules)
"""


def test_importing_megatron_core_leaves_torch_compile_until_first_use() -> None:
    """In a fresh interpreter (megatron-core not yet imported): no torch._dynamo after
    the import, the fused functions deferred; the first call goes through torch.compile
    (dynamo then loaded) and gives megatron's SwiGLU. TORCH_COMPILE_DISABLE keeps inductor
    from compiling C++ here (20 s); the compiler's own options are the next test's."""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True,
        env=env,
    ).stdout.split("\n")  # fmt: skip
    assert out[0].split() == ["no", "dynamo", "defer.<locals>.decorator", "True"], out
    assert out[1].split() == ["True", "True"], out


@pytest.fixture
def compiling():
    """Deferred functions compile (the CPU layer, active in other tests of this process,
    runs them eagerly)."""
    previous = set_eager(False)
    yield
    set_eager(previous)


def test_defer_calls_the_compiler_once_on_first_call_with_the_options(compiling) -> None:
    calls: list[dict] = []

    def compiler(fn, **options):  # records its calls, then compiles with the eager backend
        calls.append(options)
        return torch.compile(fn, backend="eager")

    jit = defer(compiler)

    @jit(dynamic=False)
    def f(x: torch.Tensor) -> torch.Tensor:
        """doc"""
        return x * 2 + 1

    @jit
    def g(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    assert calls == [] and f.__name__ == "f" and f.__doc__ == "doc"
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1) and torch.equal(f(x + 1), (x + 1) * 2 + 1)
    assert calls == [{"dynamic": False}]
    assert torch.equal(g(x), x - 1) and calls == [{"dynamic": False}, {}]
    assert torch.equal(jit(lambda x: -x)(x), -x) and len(calls) == 3


_CPU_PROBE = """
import sys
import torch
import moerl.compat
from megatron.core.fusions import fused_bias_swiglu
assert moerl.compat.activate(force=True)
x = torch.randn(4, 6)
a, b = torch.chunk(x, 2, -1)
same = torch.equal(fused_bias_swiglu.swiglu(x), torch.nn.functional.silu(a) * b)
print(same, "torch._inductor.compile_fx" in sys.modules)
"""


def test_the_cpu_layer_runs_megatrons_fused_functions_uncompiled() -> None:
    """With the CPU layer on (dynamo off), megatron's @jit_fuser functions run as written
    and torch.compile is never called: its compiler (torch._inductor.compile_fx, which
    torch.compile imports; seconds at every rank's first router forward) stays unloaded."""
    out = subprocess.run(
        [sys.executable, "-c", _CPU_PROBE], capture_output=True, text=True, timeout=300,
        check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "False"], out


def test_set_eager_skips_the_compiler_and_can_be_undone(compiling) -> None:
    calls: list[dict] = []

    def compiler(fn, **options):
        calls.append(options)
        return fn

    f = defer(compiler)(lambda x: x + 1)
    previous = set_eager(True)
    try:
        assert f(1) == 2 and calls == []
    finally:
        set_eager(previous)
    assert f(2) == 3 and calls == [{}]
