"""Child processes that die with the process that started them, and loopback ports.

Kept apart from ``moerl.parallel.spawn`` (which re-exports both) because that module
imports torch, and the launcher starts its engines before it imports torch
(moerl/engine/process.py ``WarmEngine``).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import threading

_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: a child between fork and exec only calls it.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits, even by
    SIGKILL (Linux; a no-op elsewhere). ``parent``: the pid the caller expects as its
    parent; if that one is already gone, the signal comes at once.

    SIGKILL by default: torch's spawn arms SIGINT, which a process started from a
    non-interactive shell's background job ignores, so ranks outlived a killed launcher.
    Linux ties the signal to the *thread* that started the child: start children from
    a thread that lives as long as they should."""
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def die_with(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Have this process receive ``sig`` when process ``pid`` exits, any process (not
    only its parent, which ``die_with_parent`` covers): a daemon thread waits on a
    descriptor of that process (``os.pidfd_open``, Linux 5.3+). If ``pid`` is already
    gone, the signal comes at once. Returns False where the system cannot watch
    another process (nothing is done)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return True
    except (AttributeError, OSError):  # not Linux, or a kernel without pidfd
        return False

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"moerl-die-with-{pid}", daemon=True).start()
    return True


_HANDED_OUT: set[int] = set()
"""Ports ``free_port`` returned in this process: the kernel may offer a port again once
its probe socket closed, before the first taker bound it (an engine's port and the
trainer's MASTER_PORT were once the same, and the engine could not start)."""
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback TCP port nothing is bound to now and that this process has not been
    given before (the caller binds it later: a race with other processes remains, which
    the engine narrows by binding its port as it starts, moerl/engine/__main__.py)."""
    with _HANDED_OUT_LOCK:
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise OSError("no loopback port left that this process was not given already")
