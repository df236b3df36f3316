"""Checks of the numbers a caller passes as options, each refused with an ``ArgumentError``
that names the option (a ``bool`` is not taken for a number)."""

from __future__ import annotations

import operator
from datetime import timedelta

from dcr_format.errors import ArgumentError


def whole(value: object, name: str, *, low: int, high: int | None = None) -> int:
    """``value`` as an int (any integer type: numpy's too) from ``low`` to ``high`` (no
    upper end when None)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(f"{name} must be an int, not {type(value).__name__}") from None
    if number < low or (high is not None and number > high):
        where = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ArgumentError(f"{name} must be {where}, not {number}")
    return number


def duration(value: timedelta | float, name: str) -> timedelta:
    """``value`` as a ``timedelta``: itself, or a number of seconds."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except (OverflowError, ValueError):
            raise ArgumentError(f"{name} of {value} seconds is not a duration") from None
    raise ArgumentError(
        f"{name} must be a datetime.timedelta or a number of seconds, not {type(value).__name__}"
    )
