"""Damaged checkpoints: found, named, and never skipped without a word.

A step directory is damaged when its manifest cannot be read, a file it lists
is missing or not the listed size (`store.scan`), or its engine cannot read
its files (`DamagedCheckpointError`, from `checkpoint.state.load`). A resume
(and `kd.restore` without a step) then takes the newest checkpoint that reads,
warning with the damaged step, the file and the reason and the step resumed
instead (`on_damaged="warn"`), or stops with the error (`on_damaged="raise"`).
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

from keras_dist.backends import get_adapter
from keras_dist.checkpoint import store
from keras_dist.common import job

ON_DAMAGED = ("warn", "raise")
# What the engines raise on files they cannot read (JSON and UTF-8 errors are
# ValueErrors); a lost process is a RuntimeError, a damaged file never.
_READ_ERRORS = (
    ValueError,
    OSError,
    EOFError,
    KeyError,
    IndexError,
    pickle.UnpicklingError,
)


class DamagedCheckpointError(ValueError):
    """A checkpoint that cannot be read: `step`, its `path` (the step
    directory), `file` (the damaged file where it is known, else None) and
    `reason`."""

    def __init__(
        self, message: str, *, step: int, path: str, file: str | None, reason: str
    ) -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.file = file
        self.reason = reason


def check_on_damaged(value: Any) -> str:
    if value not in ON_DAMAGED:
        raise ValueError(
            "`on_damaged` must be 'warn' (resume from the newest checkpoint "
            "that reads, warning about the damaged ones) or 'raise' (stop). "
            f"Received: on_damaged={value!r}"
        )
    return value


def is_read_error(error: BaseException) -> bool:
    """Whether an engine's error says its files cannot be read (rather than a
    lost process or a model that does not fit)."""
    return isinstance(error, _READ_ERRORS)


def error_for(step_path: str, reason: str) -> DamagedCheckpointError:
    """The error for the step directory `step_path`, damaged as `reason` says
    (a message that names the file)."""
    step = _step_of(step_path)
    return DamagedCheckpointError(
        f"The checkpoint of step {step} ({step_path}) is damaged: {reason}",
        step=step,
        path=step_path,
        file=_file_named_in(reason, step_path),
        reason=reason,
    )


def _step_of(step_path: str) -> int:
    match = re.search(r"step-(\d+)$", os.path.normpath(step_path))
    return int(match.group(1)) if match else -1


def _file_named_in(text: str, step_path: str) -> str | None:
    """The first file under `step_path` that `text` names: one that exists
    (TensorFlow's checkpoint prefix, named first, is none), else the first
    (a missing file)."""
    root = re.escape(os.path.normpath(step_path) + os.sep)
    names = [m.group(0).rstrip(".") for m in re.finditer(root + r"[^\s'\"(),:]+", text)]
    existing = [name for name in names if os.path.isfile(name)]
    return (existing or names or [None])[0]


def _all_processes_read_it(ok: bool) -> bool:
    """Every process tried the same step; they go on together (the next
    step, or this one) whatever one of them could read."""
    adapter = get_adapter()
    if adapter.num_processes() == 1:
        return ok
    gathered = adapter.gather_numbers(
        [1.0 if ok else 0.0], timeout_seconds=job.timeout_seconds()
    )
    return all(values[0] == 1.0 for values in gathered)


def restore_newest(
    directory: str,
    restore_step: Callable[[int], Any],
    *,
    on_damaged: str,
    what: str,
    taking: str,
    without: str,
) -> int | None:
    """Every process: `restore_step(step)` for the newest step of `directory`
    that reads, going past the damaged ones as `on_damaged` says. Returns the
    step restored, or None when there is none (warned about when some were
    damaged). `what` names the caller in messages ("kd.Checkpoint"),
    `taking` what it does with the step it takes ("resuming from"),
    `without` what happens when no step reads ("training starts from
    scratch")."""
    steps, damaged = store.scan(directory)
    found: list[DamagedCheckpointError] = []
    candidates = sorted(set(steps) | set(damaged), reverse=True)
    for step in candidates:
        path = store.step_directory(directory, step)
        if step in damaged:
            error = error_for(path, damaged[step])
        else:
            try:
                restore_step(step)
                error = None
            except DamagedCheckpointError as raised:
                error = raised
            if _all_processes_read_it(error is None):
                _report(found, f"{taking} step {step} instead", what=what)
                return step
            if error is None:
                error = error_for(
                    path, "another process could not read it (see that process' log)"
                )
        if on_damaged == "raise":
            raise DamagedCheckpointError(
                f"{what}: {error} Remove {path} (the newest checkpoint before it "
                "is then used), or pass on_damaged='warn' to resume from the "
                "newest checkpoint that reads.",
                step=error.step,
                path=error.path,
                file=error.file,
                reason=error.reason,
            ) from error
        found.append(error)
    _report(found, f"no checkpoint reads: {without}", what=what)
    return None


def _report(found: list[DamagedCheckpointError], instead: str, *, what: str) -> None:
    if not found or get_adapter().process_id() != 0:
        return
    damaged = "; ".join(str(error) for error in found)
    message = (
        f"{what}: {len(found)} damaged checkpoint(s) skipped, {instead}. "
        f"{damaged} Pass on_damaged='raise' to stop instead; remove the "
        "damaged step directories to silence this."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    steps = ", ".join(str(error.step) for error in found)
    print(
        f"{what}: WARNING: damaged checkpoint(s) of step {steps} skipped, "
        f"{instead} (see the warning above)",
        file=sys.stderr,
        flush=True,
    )
