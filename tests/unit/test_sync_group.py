"""The weight-sync group's TCP store listens on the master address only (issue 16, item 5):
torch's store alone listens on every interface although the engines' HTTP binds loopback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moerl.engine.weights.group import init_custom_process_group
from moerl.parallel.spawn import free_port


def _listeners(port: int) -> list[str]:
    """Addresses with a TCP socket listening on ``port`` (Linux /proc/net)."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if table == "tcp":
                    found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    found.append(table + ":" + address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net")
def test_weight_sync_store_listens_on_the_master_address_only():
    port = free_port()
    group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 1, timeout_s=10)
    assert _listeners(port) == ["127.0.0.1"]
    del group


def test_a_rank_outside_the_world_is_refused_before_any_store():
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        init_custom_process_group("gloo", "127.0.0.1", free_port(), 2, 2, timeout_s=300)


def test_joining_a_dead_address_fails_fast_and_names_it():
    """A joining rank checks that rank 0's store listens before handing the address to
    torch, whose store would retry for the whole timeout (300 s by default)."""
    import time

    start = time.monotonic()
    with pytest.raises(ValueError, match="'no-such-host.invalid' does not resolve"):
        init_custom_process_group("gloo", "no-such-host.invalid", 29500, 1, 2, timeout_s=300)
    port = free_port()  # nothing listens there
    with pytest.raises(TimeoutError, match=rf"nothing listens at .* 127\.0\.0\.1:{port} after 1 s"):
        init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, timeout_s=1)
    assert time.monotonic() - start < 30


def test_a_master_that_starts_listening_late_is_still_joined():
    import threading
    import time

    port = free_port()
    groups: dict[int, object] = {}

    def master() -> None:
        time.sleep(1.0)  # the joining rank probes before this listens
        groups[0] = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, timeout_s=30)

    thread = threading.Thread(target=master)
    thread.start()
    groups[1] = init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, timeout_s=30)
    thread.join()
    assert set(groups) == {0, 1}
