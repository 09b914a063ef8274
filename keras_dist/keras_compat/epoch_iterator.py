"""Keras' epoch iterator: whose batches an epoch reads, where it starts, how
long each read takes, what one execution of a compiled step reads."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_dist.keras_compat import batch_plans
from keras_dist.keras_compat.data_adapters import adapter_epoch, set_adapter_epoch


class EpochRouting:
    """Keras builds each epoch's batches with `iterator_class._get_iterator`;
    while a source is routed, they come from `source(data_adapter)` instead
    (the latest routed source wins; unrouting the last restores Keras')."""

    def __init__(self, iterator_class: type):
        self._class = iterator_class
        self._original = iterator_class._get_iterator
        self._sources: list[Callable[[Any], Any]] = []

    def route(self, source: Callable[[Any], Any]) -> None:
        sources = self._sources

        def get_iterator(epoch_iterator: Any) -> Any:
            return sources[-1](epoch_iterator.data_adapter)

        self._class._get_iterator = get_iterator
        sources.append(source)

    def unroute(self) -> None:
        if self._sources:
            self._sources.pop()
        if not self._sources:
            self._class._get_iterator = self._original


_EpochIterator = None  # keras.src.trainers.epoch_iterator.EpochIterator

_resume_at: list[int] = []  # the step the next epoch starts at (one-shot)

# Called right before and right after an epoch's data iterator is made (see
# `watch_new_iterators`).
_iterator_watcher: list[tuple[Callable[[], None], Callable[[], None]]] = []


def watch_new_iterators(before: Callable[[], None], after: Callable[[], None]) -> None:
    """Call `before()` right before `fit` makes an epoch's data iterator and
    `after()` right after (the moment a DataLoader or a `tf.data` pipeline
    draws from the random generators), replacing the previous watcher."""
    _install_epoch_start()
    _iterator_watcher[:] = [(before, after)]


def start_next_epoch_at(step: int) -> None:
    """The next epoch that `fit` enumerates starts at batch `step`: the first
    `step` batches are read and dropped (so the data, shuffled or not, goes
    on where it was), callbacks see `on_train_batch_begin(step)` first, and
    the progress bar counts from there. Consumed by that epoch; call it from
    `on_epoch_begin`, before the epoch reads its first batch."""
    _install_epoch_start()
    _resume_at[:] = [int(step)]


# The training adapter of the epoch `fit` enumerates next (Keras 3.16 shuffles
# from its epoch counter): whether to follow it, the counter to give it first.
_next_epoch_data: dict[str, Any] = {"follow": False, "epoch": None}
_followed_adapter: list[Any] = []  # a weak reference to it, once enumerated


def watch_next_epoch_data(resume_at: int | None = None) -> None:
    """Follow the data adapter of the epoch `fit` enumerates next (call it
    from `on_epoch_begin`: the training epoch's, before validation's); with
    `resume_at`, first set that adapter's epoch counter to it (a value
    `data_epoch()` gave when a checkpoint was saved)."""
    _install_epoch_start()
    _next_epoch_data.update(follow=True, epoch=resume_at)


def data_epoch() -> int | None:
    """The epoch counter the followed adapter shuffles from (Keras 3.16), None
    when its order comes from the global generators (Keras 3.15)."""
    adapter = _followed_adapter[0]() if _followed_adapter else None
    return None if adapter is None else adapter_epoch(adapter)


def _follow_epoch_data(data_adapter: Any) -> None:
    if not _next_epoch_data["follow"]:
        return
    resume_at = _next_epoch_data["epoch"]
    _next_epoch_data.update(follow=False, epoch=None)
    try:
        _followed_adapter[:] = [weakref.ref(data_adapter)]
    except TypeError:  # not weakly referenceable: nothing to follow
        _followed_adapter[:] = []
    if resume_at is not None:
        set_adapter_epoch(data_adapter, resume_at)


def _install_epoch_start() -> None:
    global _EpochIterator
    if _EpochIterator is not None:
        return
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    original = EpochIterator._enumerate_iterator

    @functools.wraps(original)
    def enumerate_iterator(self: Any) -> Iterator[Any]:
        start = _resume_at.pop() if _resume_at else 0
        _follow_epoch_data(self.data_adapter)
        return (yield from _enumerate_from(self, start))

    enumerate_iterator._keras_original = original
    EpochIterator._enumerate_iterator = enumerate_iterator
    _EpochIterator = EpochIterator


def _new_iterator(self: Any) -> Iterator[Any]:
    for before, _ in list(_iterator_watcher):
        before()
    iterator = iter(self._get_iterator())
    for _, after in list(_iterator_watcher):
        after()
    _announce_batch_plan(self)
    if _batch_read_timers:
        return timed_reads(iterator)
    return iterator


# What to call with the seconds each `next()` on an epoch's data iterator took
# (see `time_batch_reads`): weak references, so a callback that a raising
# `fit` never told to stop is dropped with its last user reference.
_batch_read_timers: list[Callable[[], Callable[[float], None] | None]] = []


def time_batch_reads(record: Callable[[float], None]) -> Callable[[], None]:
    """Call `record(seconds)` after each batch read from the epoch iterators
    `fit`, `evaluate` and `predict` make from now on (a `next()` on the data
    iterator), until the returned function is called or `record`'s object
    (a bound method's) is gone. Only for backends whose steps read their
    batches in Python: a TensorFlow step reads its batches inside its
    compiled function, from the iterator object itself."""
    _install_epoch_start()
    reference: Callable[[], Callable[[float], None] | None]
    if inspect.ismethod(record):
        reference = weakref.WeakMethod(record)
    else:
        reference = lambda: record  # noqa: E731
    _batch_read_timers.append(reference)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            _batch_read_timers.remove(reference)

    return stop


# What to call with each new epoch iterator's batch plan (`watch_batch_plans`),
# weak references as for the timers above.
_plan_watchers: list[Callable[[], Callable[[Any, Any, str], None] | None]] = []


def watch_batch_plans(
    record: Callable[[Any, batch_plans.BatchPlan | None, str], None],
) -> Callable[[], None]:
    """Call `record(epoch_iterator, plan, input_type)` each time `fit`,
    `evaluate` or `predict` makes an epoch's data iterator from now on (at
    the start of an epoch, or when an iterator that outlives epochs,
    `steps_per_epoch`, runs out), until the returned function is called or
    `record`'s object is gone. `epoch_iterator` tells the calls' iterators
    apart; `plan` is `batch_plans.batch_plan` of its data adapter: the rows of
    the batches the new iterator yields in order, or None when Keras cannot
    say; `input_type` names what the call was given."""
    _install_epoch_start()
    reference: Callable[[], Callable[[Any, Any, str], None] | None]
    if inspect.ismethod(record):
        reference = weakref.WeakMethod(record)
    else:
        reference = lambda: record  # noqa: E731
    _plan_watchers.append(reference)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            _plan_watchers.remove(reference)

    return stop


def _announce_batch_plan(epoch_iterator: Any) -> None:
    if not _plan_watchers:
        return
    adapter = epoch_iterator.data_adapter
    plan = batch_plans.batch_plan(adapter)
    kind = batch_plans.input_type(adapter)
    for reference in list(_plan_watchers):
        record = reference()
        if record is None:
            with contextlib.suppress(ValueError):
                _plan_watchers.remove(reference)
        else:
            record(epoch_iterator, plan, kind)


def timed_reads(iterator: Iterator[Any]) -> Iterator[Any]:
    """`iterator`'s items, each read timed and handed to the recorders of
    `time_batch_reads` (what `fit` reads its batches through while one is on)."""
    clock = time.perf_counter
    while True:
        start = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        seconds = clock() - start
        for reference in list(_batch_read_timers):
            record = reference()
            if record is None:
                with contextlib.suppress(ValueError):
                    _batch_read_timers.remove(reference)
            else:
                record(seconds)
        yield batch


def _enumerate_from(self: Any, start: int) -> Iterator[Any]:
    """Keras' `EpochIterator._enumerate_iterator`, from batch `start`, telling
    the watcher when it makes an iterator."""
    self.data_adapter.on_epoch_begin()
    steps_per_epoch = self.steps_per_epoch or self._num_batches or -1
    if steps_per_epoch > 0:
        if self._current_iterator is None or self.steps_per_epoch is None:
            self._current_iterator = _new_iterator(self)
            self._steps_seen = 0
        for _ in range(start):
            next(self._current_iterator)
        self._steps_seen += start
        for step in range(start, steps_per_epoch, self.steps_per_execution):
            if self._num_batches and self._steps_seen >= self._num_batches:
                if self.steps_per_epoch:
                    self._interrupted_warning()
                break
            self._steps_seen += self.steps_per_execution
            yield step, step + self.steps_per_execution - 1, self._current_iterator
        if self._num_batches and self._steps_seen >= self._num_batches:
            self._current_iterator = _new_iterator(self)
            self._steps_seen = 0
    else:
        iterator = _new_iterator(self)
        for _ in range(start):
            next(iterator)
        step = start - self.steps_per_execution
        while True:
            step += self.steps_per_execution
            self._steps_seen = step + self.steps_per_execution
            yield step, step + self.steps_per_execution - 1, iterator
    self.data_adapter.on_epoch_end()


# -- what one execution of a compiled step reads ---------------------------------
class _Executions:
    """Keras 3.16's JAX step functions read one item per execution: with
    `steps_per_execution > 1`, a super-batch stacked along a new first axis,
    or a `PartialBatchList` of single batches, which it runs one by one as
    Keras 3.15 ran every execution. keras_dist pads and lays out each batch
    on its own, so they go in such lists. `single_batches` is the iterator of
    the batches themselves (what reads their kept rows)."""

    def __init__(self, single_batches: Any, steps: int, group: type):
        self.single_batches = single_batches
        self._batches = iter(single_batches)
        self._steps = steps
        self._group = group

    def __iter__(self) -> _Executions:
        return self

    def __next__(self) -> Any:
        batches = []
        for batch in self._batches:
            batches.append(batch)
            if len(batches) == self._steps:
                break
        if not batches:
            raise StopIteration
        return self._group(batches)


def batches_per_execution(epoch_iterator: Any, batches: Any) -> Any:
    """`batches` (single batches) as Keras' JAX step functions read them: one
    by one up to Keras 3.15 and with `steps_per_execution` 1; in lists of up
    to `steps_per_execution` batches where Keras 3.16 reads one item per
    execution (its data adapters have `get_jax_iterator(super_batch=)`)."""
    steps = getattr(epoch_iterator, "steps_per_execution", 1) or 1
    group = _execution_group()
    if steps <= 1 or group is None:
        return batches
    return _Executions(batches, steps, group)


def reads_one_item_per_execution() -> bool:
    """Whether Keras' JAX step functions read one item per execution with
    `steps_per_execution > 1` (Keras 3.16), not one batch per step."""
    return _execution_group() is not None


def single_batches(iterator: Any) -> Any:
    """The iterator of single batches behind `batches_per_execution`."""
    return getattr(iterator, "single_batches", iterator)


@functools.cache
def _execution_group() -> type | None:
    """Keras 3.16's list of batches one execution runs one by one, or None
    where an execution reads its batches one by one itself (Keras 3.15)."""
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        data_adapter,
        data_adapter_utils,
    )

    parameters = inspect.signature(data_adapter.DataAdapter.get_jax_iterator)
    if "super_batch" not in parameters.parameters:
        return None
    return getattr(data_adapter_utils, "PartialBatchList", None)


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch the `fit` now starting begins at (read right after
    `on_train_begin`), as Keras' `BackupAndRestore` sets it; None: the
    `initial_epoch` argument."""
    model._initial_epoch = epoch


def check() -> list[str]:
    """What `start_next_epoch_at`, `watch_new_iterators`, `time_batch_reads`,
    `watch_batch_plans` and `set_initial_epoch` need."""
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    missing = []
    method = EpochIterator._enumerate_iterator
    source = inspect.getsource(getattr(method, "_keras_original", method))
    for needle in (
        "self._current_iterator",
        "self._steps_seen",
        "steps_per_execution",
        "iter(self._get_iterator())",
        "self._interrupted_warning()",
    ):
        if needle not in source:
            missing.append(f"EpochIterator._enumerate_iterator uses {needle}")
    trainer_source = inspect.getsource(type(keras.Model()).fit)
    if "self._initial_epoch or initial_epoch" not in trainer_source:
        missing.append("fit reads model._initial_epoch after on_train_begin")
    from keras.src.trainers.data_adapters import data_adapter  # noqa: PLC0415

    super_batches = (
        "super_batch"
        in inspect.signature(data_adapter.DataAdapter.get_jax_iterator).parameters
    )
    if super_batches and _execution_group() is None:
        # Keras 3.16 reads one item per execution: keras_dist hands it lists.
        missing.append("data_adapter_utils.PartialBatchList (steps_per_execution)")
    if not hasattr(EpochIterator, "data_adapter") and "self.data_adapter" not in (
        inspect.getsource(EpochIterator.__init__)
    ):
        missing.append("EpochIterator.data_adapter")
    return missing + batch_plans.check()
