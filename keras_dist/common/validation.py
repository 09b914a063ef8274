"""Argument checks shared by the public API (errors name what was received)."""

from __future__ import annotations

from typing import Any


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise unless `value` is a positive int (or None, when `optional`).

    Raises:
        TypeError: `value` is not an int (a bool is not one here).
        ValueError: `value` is an int below 1.
    """
    if value is None and optional:
        return
    allowed = f"a positive int{' or None' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"`{name}` must be {allowed}. Received: {name}={value!r} of type "
            f"{type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"`{name}` must be {allowed}. Received: {name}={value!r}")
