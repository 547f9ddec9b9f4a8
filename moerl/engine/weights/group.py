"""A process group between trainer rank 0 and the engines, beside any other group.

The trainer already has its default (megatron) group, and SGLang servers have
their own; weight sync needs a separate group spanning trainer rank 0 and every
engine. Like SGLang's ``init_custom_process_group``, this builds a gloo or NCCL
group on its own TCP store without touching the default group. Rank 0 (the
trainer) hosts the store, listening on the master address only (torch's store
would listen on every interface).
"""

from __future__ import annotations

import errno
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join a new ``backend`` group of ``world_size`` ranks as ``rank``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' or 'nccl'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if rank != 0:  # torch's store would retry a dead address for the whole timeout
        wait_for_listener(master_address, int(master_port), min(timeout_s, PROBE_S))
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=_listen(master_address, int(master_port)) if rank == 0 else None,
    )
    # ignores: torch's stubs type these c10d backends as `Backend`, a class they give none
    # of the collectives (broadcast) the bindings have, and list only ProcessGroupNCCL's
    # (store, rank, size, options) constructor, not its (store, rank, size, timeout=...).
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))  # type: ignore[return-value]
    return dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg,return-value]


PROBE_S = 30.0
"""How long a joining rank waits for rank 0's store to listen before it gives up."""


def wait_for_listener(address: str, port: int, within_s: float) -> None:
    """Return once something accepts TCP connections at ``address:port``; ValueError at
    once for a name that does not resolve or a host that cannot be reached, TimeoutError
    naming the address after ``within_s`` of refused or unanswered connections (rank 0
    may start listening a moment after the others start joining)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((address, port), timeout=min(2.0, within_s)).close()
            return
        except socket.gaierror as err:
            raise ValueError(
                f"the weight-update group's master_address {address!r} does not resolve "
                f"({err}); give rank 0's address as this host can reach it"
            ) from None
        except OSError as err:
            if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                raise ValueError(
                    f"the weight-update group's master {address}:{port} cannot be reached "
                    f"from this host ({err.strerror}); check master_address and the network"
                ) from None
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"nothing listens at the weight-update group's master {address}:{port} "
                    f"after {within_s:g} s ({err.strerror or err}); is trainer rank 0 "
                    "running, and are master_address and master_port the ones it listens on?"
                ) from None
            time.sleep(0.1)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``src`` over a group made here (blocking)."""
    group.broadcast(tensor, src).wait()


def _listen(address: str, port: int) -> int:
    """A socket listening on ``address:port`` only; the store takes over its descriptor."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()
