"""``moerl.common.children.die_with``: a process dies with another that is not its parent."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

WATCHER = """
import sys, time
from moerl.common.children import die_with
assert die_with(int(sys.argv[1]))
print("armed", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="pidfd_open is Linux's")
def test_a_process_dies_with_the_one_it_watches() -> None:
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(watched.pid)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout is not None and watcher.stdout.readline() == "armed\n"
        assert watcher.poll() is None
        watched.kill()
        watched.wait()
        assert watcher.wait(timeout=60) == -signal.SIGKILL
    finally:
        for proc in (watched, watcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="pidfd_open is Linux's")
def test_a_process_watching_one_already_gone_dies_at_once() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(gone.pid)])
    assert watcher.wait(timeout=60) == -signal.SIGKILL


def test_free_port_never_gives_a_port_twice() -> None:
    """The kernel may offer a just-probed port again; two callers (an engine and the
    trainer's MASTER_PORT) must not both get it."""
    from moerl.common.children import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
