"""The job's shared facts, set once and read everywhere.

Which job this process joined (`keras_dist.initialize()` records it, and that
it was called at all), how long any wait for the other processes may last
(`KERAS_DIST_INIT_TIMEOUT`), and this process' rank (asked of the backend
adapter, which registers itself when it is created, as Lightning's
`rank_zero_only.rank` is set once by its strategy).
This module asks nobody: code on every layer reads these facts here instead of
importing the layer that knows them.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

#: How long, in seconds, to wait for the other processes (joining the job, a
#: barrier, process 0's file), unless `KERAS_DIST_INIT_TIMEOUT` says otherwise.
DEFAULT_TIMEOUT_SECONDS = 300.0
TIMEOUT_VARIABLE = "KERAS_DIST_INIT_TIMEOUT"


def timeout_seconds() -> float:
    """`KERAS_DIST_INIT_TIMEOUT` (default 300): how long any wait for the other
    processes of the job may last.

    Raises:
        ValueError: the variable is not a positive, finite number.
    """
    raw = os.environ.get(TIMEOUT_VARIABLE, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_SECONDS
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):  # "nan", "inf", "-1"
        raise ValueError(
            f"{TIMEOUT_VARIABLE} must be a positive number of seconds. "
            f"Received: {TIMEOUT_VARIABLE}={raw!r}"
        )
    return seconds


# -- the job this process joined -------------------------------------------------
_joined: dict[str, object] = {}
_when_joined: list[Callable[[], None]] = []


def record_join(coordinator: str, num_processes: int, process_id: int) -> None:
    """Record the job this process joined, then run the `when_joined` hooks."""
    _joined.update(
        {"coordinator": coordinator, "count": num_processes, "rank": process_id}
    )
    for hook in list(_when_joined):
        hook()


def joined() -> dict[str, object]:
    """The job `record_join` recorded (`coordinator`, `count`, `rank`), or `{}`
    when this process joined none (yet)."""
    return dict(_joined)


def forget_join() -> None:
    """Forget the joined job, and that `initialize` was called (for tests
    that simulate one)."""
    _joined.clear()
    _initialize_called.clear()


_initialize_called: list[bool] = []


def record_initialize() -> None:
    """Record that `keras_dist.initialize()` returned: the job it resolved,
    even one of a single process the user asked for under a launcher of
    several, is the user's choice."""
    _initialize_called[:] = [True]


def initialize_called() -> bool:
    """Whether `keras_dist.initialize()` returned in this process."""
    return bool(_initialize_called)


def when_joined(hook: Callable[[], None]) -> None:
    """Call `hook()` each time a job is joined, right after it is recorded: the
    layers above the runtime switch on what a job of several processes needs
    (one writer) without the runtime importing them."""
    if hook not in _when_joined:
        _when_joined.append(hook)


# -- this process' rank ----------------------------------------------------------
_rank_source: list[Callable[[], int]] = []


def set_rank_source(process_id: Callable[[], int]) -> None:
    """Where `process_id()` asks from now on (the backend adapter)."""
    _rank_source[:] = [process_id]


def process_id() -> int:
    """This process' rank: 0 until a backend adapter exists (no job can have
    started without one)."""
    return _rank_source[0]() if _rank_source else 0


_warned: set[object] = set()


def warn_once(
    message: str,
    category: type[Warning],
    stacklevel: int = 2,
    *,
    key: object = None,
) -> None:
    """Warn once per message (or per `key`), and only on process 0 of a
    multi-process job.

    Args:
        message: what to say.
        category: the warning's class, e.g. `UserWarning`.
        stacklevel: as for `warnings.warn`, counted from the caller.
        key: what makes two warnings the same one (hashable); defaults to
            the category and the message.
    """
    key = (category, message) if key is None else key
    if key in _warned or process_id() != 0:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
