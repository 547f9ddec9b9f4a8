"""Errors raised by the engine client and the response decoders."""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine refused, failed or could not be reached.

    `urls` are the engine base URLs involved, `status_code` the HTTP status when there was a
    response (None for connection errors and timeouts).
    """

    def __init__(
        self, message: str, *, urls: list[str] | None = None, status_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.urls = list(urls or [])
        self.status_code = status_code


class RoutedExpertsMissing(EngineError):
    """Routed experts were requested but the response has none: the server was started
    without routing capture. Never train with replay on such a rollout."""


class SamplingMaskMissing(EngineError):
    """A sampling mask was requested but the response has none."""
