"""Triton stays out of CPU-only processes (moerl/common/triton_hold.py): the CPU layer and
the engine's entry point hold it back, megatron-core takes its no-Triton path, and
``TRITON_INTERPRET=1`` still loads it. Each case runs in a fresh interpreter: this test
process has imported Triton already (tests/conftest.py runs kernels in its interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moerl.device import has_cuda

pytestmark = pytest.mark.skipif(has_cuda(), reason="the hold applies only without CUDA")


def _run(code: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_cpu_layer_keeps_triton_out_of_megatron_core():
    out = _run(
        """
        import sys
        import torch
        from moerl import compat
        from moerl.kernels.dispatch import backend, use_triton
        assert compat.activate()
        import megatron.core.utils as mcore_utils
        import torch._dynamo  # torch's compiler imports Triton when it can
        print("loaded", "triton" in sys.modules, mcore_utils.HAVE_TRITON)
        try:
            import triton
        except ModuleNotFoundError as err:
            print("error", err)
        with backend("triton"):
            try:
                use_triton(torch.zeros(1))
            except RuntimeError as err:
                print("kernels", err)
        compat.deactivate()
        import triton
        print("after deactivate", "triton" in sys.modules)
        """,
        interpret=False,
    )
    assert "loaded False False" in out
    assert "error triton is held back in this CPU-only process" in out
    assert "set TRITON_INTERPRET=1" in out
    # the kernels' own error does not claim Triton is missing
    assert "kernels kernels backend 'triton' cannot run here: the inputs are on the CPU" in out
    assert "after deactivate True" in out


def test_triton_interpret_lets_triton_load():
    out = _run(
        """
        import sys
        from moerl import compat
        from moerl.common import triton_hold
        compat.activate()
        import megatron.core.utils as mcore_utils
        print("loaded", "triton" in sys.modules, mcore_utils.HAVE_TRITON,
              triton_hold.is_held_back())
        """,
        interpret=True,
    )
    assert "loaded True True False" in out


def test_the_hold_is_not_installed_once_triton_is_imported():
    out = _run(
        """
        import triton
        from moerl.common import triton_hold
        print("held", triton_hold.hold_back(), triton_hold.is_held_back())
        """,
        interpret=False,
    )
    assert "held False False" in out


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_engine_process_maps_no_triton(tiny_checkpoints, monkeypatch):
    """A CPU engine loads its transformers model (which imports torch's compiler) and
    serves, without libtriton in its address space."""
    from moerl.engine.process import EngineProcess

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = EngineProcess(tiny_checkpoints["deepseek_moe"], threads=1)
    try:
        import httpx

        r = httpx.post(
            f"{engine.url}/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        maps = _maps(engine.proc.pid)
        assert "libtorch_cpu" in maps  # the check reads the right process
        assert "libtriton" not in maps
    finally:
        engine.close()
