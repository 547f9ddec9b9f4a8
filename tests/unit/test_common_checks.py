"""moerl.common.checks: the one choice check for string options and the range helpers."""

from __future__ import annotations

import enum

import pytest

from moerl.common.checks import (
    at_least,
    choice_error,
    finite,
    non_negative_int,
    one_of,
    positive_int,
    positive_seconds,
)


class Mode(enum.Enum):
    ABORT = "abort"
    DRAIN = "drain"


def test_one_of_takes_a_tuple_or_an_enum_and_names_the_choices():
    one_of("rollout.mode", "drain", ("abort", "drain"))
    one_of("rollout.mode", "drain", Mode)
    msg = "rollout.mode='later' is not supported; choose one of 'abort', 'drain'"
    for allowed in (("abort", "drain"), Mode):
        with pytest.raises(ValueError) as err:
            one_of("rollout.mode", "later", allowed)
        assert str(err.value) == msg
    assert str(choice_error("KL estimator", "k4", ("k1", "k2"))) == (
        "KL estimator='k4' is not supported; choose one of 'k1', 'k2'"
    )


def test_range_helpers():
    at_least("a.b", 0.0, 0.0)
    with pytest.raises(ValueError, match=r"^a.b=0.0 must be > 0.0$"):
        at_least("a.b", 0.0, 0.0, strict=True)
    with pytest.raises(ValueError, match=r"^a.b=-1 must be >= 0$"):
        at_least("a.b", -1, 0)
    positive_int("n", 1)
    non_negative_int("n", 0)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="must be a positive integer"):
            positive_int("n", bad)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        non_negative_int("n", -1)
    finite("x", 1e30)
    with pytest.raises(ValueError, match="must be a finite number"):
        finite("x", float("nan"))
    positive_seconds("t", 0.5)
    with pytest.raises(ValueError, match=r"^t=0 must be > 0.0$"):
        positive_seconds("t", 0)
