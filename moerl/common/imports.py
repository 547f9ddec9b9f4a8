"""Importing a user's ``_target_`` through Hydra without Hydra's duplicate error line."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_hydra_utils() -> Iterator[None]:
    """hydra.utils logs an ERROR ("Error getting callable at ...") before raising the
    error moerl reports with the config key; the user saw the failure twice."""
    logger = logging.getLogger("hydra.utils")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled
