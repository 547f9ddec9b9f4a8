"""Start-up checks that raise ValueError naming the config key, the bad value and the fix.

One mechanism for string options, `one_of(key, value, allowed)`, where `allowed` is a tuple
of strings or an Enum type (its members' values), and one copy of the range helpers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from enum import Enum


def _allowed(allowed: Iterable[object] | type[Enum]) -> tuple[object, ...]:
    if isinstance(allowed, type) and issubclass(allowed, Enum):
        return tuple(member.value for member in allowed)
    return tuple(allowed)


def choice_error(key: str, value: object, allowed: Iterable[object] | type[Enum]) -> ValueError:
    """The error for `value` outside `allowed`; for dispatch code that has no check up front."""
    choices = ", ".join(repr(a) for a in _allowed(allowed))
    return ValueError(f"{key}={value!r} is not supported; choose one of {choices}")


def one_of(key: str, value: object, allowed: Iterable[object] | type[Enum]) -> None:
    """`value` is one of `allowed` (a tuple of options or an Enum type)."""
    if value not in _allowed(allowed):
        raise choice_error(key, value, allowed)


def auto_or_bool(key: str, value: object) -> None:
    """'auto', true or false (a tri-state option whose 'auto' a rule resolves)."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"{key}={value!r}: choose auto, true or false")


def at_least(key: str, value: float, low: float, *, strict: bool = False) -> None:
    """`value >= low` (`> low` with strict)."""
    if value < low or (strict and value == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"{key}={value!r} must be {bound}")


def positive_int(key: str, value: object) -> None:
    """An int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r} must be a positive integer")


def positive_int_or_off(key: str, value: object, off: str) -> None:
    """An int >= 1 (not a bool), or -1, whose meaning ``off`` completes "or -1 ..."."""
    if value != -1 and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{key}={value!r} must be a positive integer, or -1 {off}")


def non_negative_int(key: str, value: object) -> None:
    """An int >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}={value!r} must be an integer >= 0")


def finite(key: str, value: object) -> None:
    """An int or float that is neither NaN nor infinite (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number")


def positive_seconds(key: str, value: object) -> None:
    """A finite number of seconds > 0."""
    finite(key, value)
    at_least(key, value, 0.0, strict=True)  # type: ignore[arg-type]


DEVICE_NAMES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(key: str, name: object) -> None:
    """``name`` is one of ``DEVICE_NAMES`` (ValueError naming ``key`` otherwise); whether
    this machine has that device is ``moerl.device.resolve``'s question, asked where it
    runs. Torch-free, so validation does not import torch."""
    if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"{key}={name!r} is not a device; choose {DEVICE_NAMES}")
