"""The largest global batch a distribution fits, found by compiling it.

`keras_dist.plan_search(..., largest_batch=True)` takes the best candidate
(it fits at the batch given) and compiles it at larger batches, as MaxText's
memory estimator does: doubling until one does not fit, then halving the gap
between the largest that fits and the smallest that does not, in multiples of
the data-parallel shards, within `MAX_COMPILES` compiles and the search's
time budget. Each verdict is XLA's (the compiled peak against the memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_dist.planner.candidates import Candidate

#: At most this many compiles search the largest batch.
MAX_COMPILES = 8


@dataclass(frozen=True)
class LargestBatch:
    """The largest global batch found to fit one candidate.

    Attributes:
        candidate: the candidate searched.
        batch_size: the largest global batch compiled that fits.
        too_large: the smallest compiled that does not fit; None when every
            batch compiled fits (the compiles or the time ran out first).
        step: batches are multiples of it (the data-parallel shards) beyond
            the one given.
        tried: `(batch, fits)` for each compile, in order.
        stopped: why the search stopped before the two met, or None.
    """

    candidate: Candidate
    batch_size: int
    too_large: int | None
    step: int
    tried: tuple[tuple[int, bool], ...]
    stopped: str | None = None

    @property
    def exact(self) -> bool:
        """Whether the next multiple of `step` was compiled and does not fit."""
        return self.too_large is not None and self.too_large - self.batch_size <= (
            self.step
        )

    def __str__(self) -> str:
        text = (
            f"The largest global batch that fits {self.candidate.description}: "
            f"{self.batch_size}"
        )
        if self.exact:
            text += f" ({self.too_large} does not)"
        elif self.too_large is not None:
            text += f" at least ({self.too_large} does not)"
        else:
            text += " at least"
        text += f", in {len(self.tried)} compiles"
        return text + (f"; {self.stopped}" if self.stopped else "")


def largest_batch(
    candidate: Candidate,
    fits_at: Callable[[int], bool | None],
    start: int,
    step: int,
    deadline: float | None,
) -> LargestBatch:
    """Search from `start` (a batch that fits) by compiling `fits_at(batch)`
    (True, False, or None when XLA's verdict is not known)."""
    step = max(1, step)
    low, high = start, None
    tried: list[tuple[int, bool]] = []
    stopped = None
    while True:
        if high is None:
            batch = low * 2
        else:
            middle = low + (high - low) // 2
            batch = max(low + step, (middle // step) * step)
            if batch >= high:
                break
        if len(tried) >= MAX_COMPILES:
            stopped = f"stopped after {MAX_COMPILES} compiles"
            break
        if deadline is not None and time.monotonic() >= deadline:
            stopped = "stopped: the time budget was spent"
            break
        verdict = fits_at(batch)
        if verdict is None:
            stopped = f"stopped: whether batch {batch} fits is not known"
            break
        tried.append((batch, verdict))
        if verdict:
            low = batch
        else:
            high = batch
    return LargestBatch(candidate, low, high, step, tuple(tried), stopped)


def best_largest_batch(
    results: Any,
    compile_at: Callable[[Candidate, int], Any],
    batch_size: int,
    deadline: float | None,
) -> LargestBatch | None:
    """The largest batch `results`' best candidate fits, compiled by
    `compile_at(candidate, batch)` (an `Outcome` of the search), said in the
    results' notes too; None where no candidate is known to fit."""
    best = results.best
    if best is None or best.fits is not True:
        results.notes.append(
            "largest_batch=True: not searched, no candidate is known to fit at "
            f"batch_size={batch_size} (a smaller batch, or device_memory= where "
            "the memory is not known)."
        )
        return None

    def fits_at(batch: int) -> bool | None:
        outcome = compile_at(best.candidate, batch)
        if outcome.screened:
            return False
        if outcome.error or outcome.compiled is None:
            return None
        return outcome.compiled.fits

    found = largest_batch(
        best.candidate, fits_at, batch_size, best.candidate.mesh["batch"], deadline
    )
    results.notes.append(f"{found}.")
    return found


__all__ = ["MAX_COMPILES", "LargestBatch", "best_largest_batch", "largest_batch"]
