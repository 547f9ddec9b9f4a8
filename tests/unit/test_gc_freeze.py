"""launcher.gc_freeze: the collector off while a process starts, then one collection, the
survivors frozen out of later scans and the collector back on (moerl/common/gc_freeze.py,
moerl/loop.py, moerl/launch.py, moerl/engine/__main__.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from moerl.common.children import free_port


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_collects_first_then_keeps_the_survivors_out_of_the_scans() -> None:
    from moerl.common.gc_freeze import freeze_gc

    gc.unfreeze()
    try:
        kept = Cycle()  # alive: frozen
        Cycle()  # garbage in a cycle: collected, not frozen for good
        count, seconds = freeze_gc()  # (frozen objects still die by reference count)
        assert count > 0 and seconds >= 0
        scanned = gc.get_objects()  # generations 0-2; the permanent one is not listed
        assert not any(o is kept for o in scanned)
        assert not any(type(o) is Cycle for o in scanned)  # the garbage one is gone
        later = Cycle()
        assert any(o is later for o in gc.get_objects())  # made after: scanned again
    finally:
        gc.unfreeze()


def test_the_first_steps_freeze_turns_the_collector_back_on() -> None:
    """The launcher disables the collector for the start; the loop's freeze after the
    first step enables it again (on ranks without the rollout side too)."""
    from moerl.loop import _freeze_gc

    gc.disable()
    gc.unfreeze()
    try:
        _freeze_gc(None)
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.enable()
        gc.unfreeze()


def test_an_engine_process_starts_with_its_model_frozen(tiny_checkpoints) -> None:
    """``python -m moerl.engine``'s start-up: the collector is off while the model loads,
    then what loaded is frozen and the collector runs again. uvicorn's serving loop is
    replaced by a print of the collector's state (the engine's own start runs as is)."""
    script = (
        "import gc, sys, uvicorn\n"
        "uvicorn.Server.run = lambda self, sockets=None: print('frozen', gc.get_freeze_count(), "
        "'enabled', gc.isenabled())\n"
        "from moerl.engine.__main__ import main\n"
        "main(sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "--model-path", str(tiny_checkpoints["qwen3_moe"]),
         "--port", str(free_port()), "--num-threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.split()
    frozen, enabled = words[words.index("frozen") + 1], words[words.index("enabled") + 1]
    assert int(frozen) > 10_000 and enabled == "True"
