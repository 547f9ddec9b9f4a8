"""Requests' stand-ins for the engine's KV pool: a pool's ``alloc`` gives a slot to an
owner by setting ``owner.slot`` (tests/unit/test_engine_kv_pool.py and the other tests
that drive a ``ModelRunner`` over a pool without the scheduler)."""

from __future__ import annotations

from typing import Any


class Owner:
    def __init__(self) -> None:
        self.slot: int | None = None


def allocated(pool: Any, count: int) -> list[Owner]:
    """``count`` owners, each given a slot of ``pool`` in turn."""
    owners = [Owner() for _ in range(count)]
    for owner in owners:
        pool.alloc(owner)
    return owners
