"""Which steps of an epoch `Throughput` measures, and the real rows they hold.

A step's rows come from the batch plan of the epoch's data iterator
(`keras_compat.batch_plans`): Keras' adapter for arrays, a sized torch
`DataLoader` or a `tf.data.Dataset` with a static batch dimension knows the
rows of every batch, the short last one included, before reading them. The
rows are the global batch's (keras_dist pads an uneven batch and masks the
padding; the rows counted are the real ones).

Left out of the figures, and named: the first step of each epoch (the clock
starts at its end: its time holds the epoch's start, the data iterator
starting, and in the first epoch the compilation), and the first step of every
batch size not seen before in this `fit` (on JAX and TensorFlow a new shape
compiles the step again: the short last batch of the first epoch). When the
input does not say its batch sizes (a generator, a `PyDataset`, a
`tf.data.Dataset` whose last batch may be short), each step counts
`batch_size` rows and the last step of every epoch, which may be short, is
left out too.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple


class StepSeconds(NamedTuple):
    """One step's times, in seconds: from the end of the step before to its
    end, inside it (less the batch reads), reading its batches."""

    elapsed: float
    compute: float
    data: float


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """A call of the train function left out of the figures: its steps (1 for
    the first batch of the epoch) and why."""

    first: int
    last: int
    why: str

    def describe(self) -> str:
        steps = (
            f"step {self.first}"
            if self.first == self.last
            else f"steps {self.first}-{self.last}"
        )
        return f"{steps} ({self.why})"


class StepLedger:
    """The measured steps of one epoch at a time (see the module docstring).

    Args:
        batch_size: the rows a step counts when the input does not say.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.new_fit()

    # -- the fit and its batch plans -----------------------------------------------
    def new_fit(self) -> None:
        """Forget the previous `fit`: its plans and the batch sizes it saw."""
        self._source: Any = None  # a weak reference to fit's epoch iterator
        self._candidate: tuple[Any, Any, str] | None = None
        self._plan: Any = None
        self._position: int | None = None
        self._seen_sizes: set[int] = set()
        self.input_type: str | None = None
        self.new_epoch()

    def plan_announced(self, source: Any, plan: Any, input_type: str) -> None:
        """`keras_compat.epoch_iterator.watch_batch_plans`' report: `source`
        made a new data iterator whose batches hold `plan`'s rows."""
        if self._source is None:
            # The iterator made last before fit's first step is fit's own
            # (the ones evaluate or predict make come later, or earlier).
            self._candidate = (weakref.ref(source), plan, input_type)
        elif self._source() is source:
            self._plan, self._position = plan, None

    def step_begins(self, batch: int) -> None:
        if self._source is None and self._candidate is not None:
            self._source, self._plan, self.input_type = self._candidate
            self._position = None

    @property
    def rows_known(self) -> bool:
        """Whether the steps' rows are counted (else `batch_size` a step)."""
        return self._plan is not None

    def _sizes(self, first: int, count: int) -> list[int] | None:
        if self._plan is None:
            return None
        if self._position is None:
            # A new iterator: an epoch resumed mid-way starts at its first
            # step's batch (`epoch_iterator.start_next_epoch_at`).
            self._position = first
        start, self._position = self._position, self._position + count
        return [self._plan.rows(position) for position in range(start, start + count)]

    # -- one epoch -----------------------------------------------------------------
    def new_epoch(self) -> None:
        self.seconds = StepSeconds(0.0, 0.0, 0.0)
        self.measured_steps = 0
        self.measured_samples = 0
        self.total_steps = 0
        self.left_out: list[LeftOut] = []
        self._unconfirmed: tuple[StepSeconds, int, int, int, int] | None = None

    def step_ends(self, first: int, last: int, seconds: StepSeconds | None) -> None:
        """The call that ran batches `first` to `last` (0-based) ended; its
        `seconds`, or None for the epoch's first call (nothing to time)."""
        count = last - first + 1
        self.total_steps += count
        sizes = self._sizes(first, count)
        new = sorted(set(sizes) - self._seen_sizes) if sizes is not None else []
        self._seen_sizes.update(sizes or ())
        if seconds is None:
            self._leave_out(first, last, "the epoch's first: its time holds the start")
            return
        if new:
            rows = ", ".join(map(str, new))
            self._leave_out(
                first,
                last,
                f"the first batch of {rows} rows: a new shape compiles the step again",
            )
            return
        if sizes is not None:
            self._count(seconds, count, sum(sizes))
            return
        # Rows unknown: this step counts batch_size rows unless it turns out to
        # be the epoch's last, which may be short.
        self._confirm()
        self._unconfirmed = (seconds, count, count * self.batch_size, first, last)

    def epoch_ends(self) -> None:
        if self._unconfirmed is not None:
            _, _, _, first, last = self._unconfirmed
            self._unconfirmed = None
            self._leave_out(
                first, last, "the epoch's last: it may hold fewer rows, unknown here"
            )

    def _confirm(self) -> None:
        if self._unconfirmed is not None:
            seconds, count, rows, _, _ = self._unconfirmed
            self._unconfirmed = None
            self._count(seconds, count, rows)

    def _count(self, seconds: StepSeconds, count: int, rows: int) -> None:
        self.seconds = StepSeconds(
            *(a + b for a, b in zip(self.seconds, seconds, strict=True))
        )
        self.measured_steps += count
        self.measured_samples += rows

    def _leave_out(self, first: int, last: int, why: str) -> None:
        self.left_out.append(LeftOut(first + 1, last + 1, why))

    @property
    def left_out_steps(self) -> int:
        return sum(entry.last - entry.first + 1 for entry in self.left_out)

    def describe_left_out(self) -> str:
        """`"left out: step 1 (...), step 32 (...)"` (at most three: the
        first step, a new batch size, a last step of unknown rows)."""
        named = [entry.describe() for entry in self.left_out]
        return "left out: " + ", ".join(named) if named else "none left out"
