"""Fault handling of rollout generation: which errors a retry can fix, the client the
rollout config asks for, and best-effort aborts.

Per request, the client (moerl.rollout.transport) re-sends a /generate that failed with a
connection error, timeout or HTTP 5xx on an engine not tried yet and keeps the failed
engine out of the rotation for `cooldown_s`. Per group, the orchestrator generates a
group whose request still failed again from scratch (rollout.max_group_attempts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from moerl.config.rollout import RolloutConfig
from moerl.rollout.client import EngineClient
from moerl.rollout.errors import EngineError, RoutedExpertsMissing, SamplingMaskMissing

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


def make_client(urls: str | Sequence[str], cfg: RolloutConfig, **kwargs: Any) -> EngineClient:
    """An EngineClient with the rollout config's retry, timeout and cooldown settings."""
    return EngineClient(
        urls,
        timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        cooldown_s=cfg.engine_cooldown_s,
        **kwargs,
    )


def is_fatal(err: BaseException) -> bool:
    """True for errors that generating the group again cannot fix: HTTP 4xx, a server
    without routing or mask capture, an invalid trajectory, a failing reward function."""
    if isinstance(err, (RoutedExpertsMissing, SamplingMaskMissing)):
        return True
    if isinstance(err, EngineError):
        return err.status_code is not None and 400 <= err.status_code < 500
    return True


async def abort_prefix(client: EngineClient, rid_prefix: str) -> None:
    """Best effort: every engine drops the requests whose rid starts with rid_prefix
    (SGLang matches rids by prefix). Unreachable engines are ignored."""
    try:
        await asyncio.wait_for(client.abort_request(rid=rid_prefix), ABORT_TIMEOUT_S)
    except (EngineError, asyncio.TimeoutError) as err:
        log.debug("abort_request(%s) failed: %s", rid_prefix, err)
