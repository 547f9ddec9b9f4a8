"""Spawned ranks die with the process that spawned them, however it dies, and a failed
rank leaves no error file in the temp folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from moerl.parallel import spawn

# A parent that spawns two ranks which would sleep for ten minutes. It ignores SIGINT as
# a background job of a non-interactive shell does (`moerl.launch ... &` in a script),
# and its children inherit that: torch's own parent-death signal is SIGINT.
PARENT = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
from moerl.parallel.spawn import spawn
spawn(time.sleep, 2, 600, threads=1)
"""


def _ranks(parent: psutil.Process) -> list[psutil.Process]:
    """The parent's ranks: its children started by ``spawn`` (a CUDA build of torch), or
    the children of its forkserver (forked, they share the server's command line)."""
    ranks = []
    for child in parent.children():
        line = " ".join(child.cmdline())
        if "spawn_main" in line:
            ranks.append(child)
        elif "forkserver" in line:
            ranks.extend(child.children())
    return ranks


def test_ranks_die_when_the_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    family: list[psutil.Process] = []
    try:
        proc = psutil.Process(parent.pid)
        deadline = time.time() + 120
        while len(_ranks(proc)) < 2:
            assert parent.poll() is None and time.time() < deadline, "no ranks started"
            time.sleep(0.1)
        family = proc.children(recursive=True)  # the ranks and multiprocessing's tracker
        os.kill(parent.pid, signal.SIGKILL)  # the parent only, not its process group
        parent.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for p in family:
            if p.is_running():
                p.kill()
        if parent.poll() is None:
            parent.kill()


def _fail() -> None:
    raise ValueError("a rank failed on purpose")


def test_a_failed_rank_leaves_no_error_file(tmp_path, monkeypatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where torch puts its error files
    with pytest.raises(Exception, match="a rank failed on purpose"):
        spawn(_fail, 1, threads=1)
    # multiprocessing's own folder (pymp-*: the forkserver's socket, when this test started
    # the server) lives as long as this process and is not an error file
    assert [p for p in temp.iterdir() if not p.name.startswith("pymp-")] == []
