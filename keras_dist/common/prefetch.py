"""Batches made ahead, on a thread of their own, while the device computes.

On an accelerator each step's input is made on the host (Keras slices and
shuffles the arrays, keras_dist pads the batch and starts its copy to the
devices) while the previous step runs on the device. Made in turn, as Keras
makes them, the host's work adds to every step; made ahead on threads, as
tf.data's `prefetch` and flax's `prefetch_to_device` do, it overlaps the
device's work and Keras' own loop. Two stages, each on its own thread, so that
reading a batch and placing the one before it overlap too (NumPy's copies and
the device transfers release the GIL):

```
  main thread     step i-1  | step i    | step i+1  |  dispatch, callbacks
  read thread     batch i+2 | batch i+3 | batch i+4 |  Keras slices, shuffles
  make thread     batch i+1 | batch i+2 | batch i+3 |  pad, place on devices
                 each stage hands over through a queue of `depth` batches
```

The batches come out in the order the source gives them; the source is read
by the read thread alone once it started (the caller reads the first batches
itself, where collectives of a multi-process job run). An error of the source
is raised by the `next` that would have returned its batch. The thread holds
no reference to the consumer: an iterator that is dropped (an epoch that
ends, a run that stops) stops its threads, and `close()` stops them at once;
a thread blocked on a queue checks every `_POLL_SECONDS` whether it was
stopped, so none outlives its iterator (but for a source blocked in its own
`next`, which ends when that returns), and none keeps the process alive
(daemon threads).

Backend-neutral: `make` is whatever the adapter does to a batch.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

PREFETCH_VARIABLE = "KERAS_DIST_PREFETCH_BATCHES"
# Flax's `prefetch_to_device` default; tf.data's AUTOTUNE settles near it.
ACCELERATOR_DEPTH = 2
_POLL_SECONDS = 0.1
_DONE = object()


def prefetch_depth(platform: str, steps_per_execution: int = 1) -> int:
    """How many batches to make ahead on `platform` ("cpu", "tpu", "gpu"...)
    for a model compiled with `steps_per_execution`:
    `KERAS_DIST_PREFETCH_BATCHES` when set (0 turns the threads off), else 2
    on an accelerator when an execution runs several steps and 0 otherwise.

    Measured on a TPU v5e chip (`benchmarks/README.md`), with the host
    bounding the step (8 MiB of input a step): with `steps_per_execution` 16
    the threads take 7% off plain Keras' step time; with 1, Keras' loop runs
    Python on the main thread at every step (callbacks, logs) and the threads
    compete with it for the interpreter: 6% slower than making each batch
    when the step asks for it, which is at plain Keras' time. On CPUs the
    host that would make the batches is the device that computes.

    Raises:
        ValueError: the variable is not a whole number >= 0.
    """
    raw = os.environ.get(PREFETCH_VARIABLE, "").strip()
    if not raw:
        if platform == "cpu" or steps_per_execution <= 1:
            return 0
        return ACCELERATOR_DEPTH
    if not raw.isdigit():
        raise ValueError(
            f"{PREFETCH_VARIABLE} must be a whole number of batches, 0 or more "
            f"(0: make each batch when the step asks for it). Received: "
            f"{PREFETCH_VARIABLE}={raw!r}"
        )
    return int(raw)


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _hand_over(ready: queue.Queue, item: Any, stopped: threading.Event) -> bool:
    """Put `item` in `ready`, waiting for room until `stopped`; whether it
    was put."""
    while not stopped.is_set():
        try:
            ready.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _read(source: Iterator[Any], read: queue.Queue, stopped: threading.Event) -> None:
    """The first stage: the source's batches, in order (Keras slicing and
    shuffling the arrays, a generator's or a `tf.data` pipeline's work)."""
    try:
        for batch in source:
            if stopped.is_set() or not _hand_over(read, batch, stopped):
                return
        _hand_over(read, _DONE, stopped)
    except BaseException as error:  # handed to the consumer, raised there
        _hand_over(read, _Failure(error), stopped)


def _make(
    make: Callable[[Any], Any],
    read: queue.Queue,
    ready: queue.Queue,
    stopped: threading.Event,
) -> None:
    """The second stage: `make` each batch read (pad it, start its copy to
    the devices), in order."""
    while not stopped.is_set():
        try:
            batch = read.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            continue
        if batch is _DONE or isinstance(batch, _Failure):
            _hand_over(ready, batch, stopped)
            return
        try:
            made = make(batch)
        except BaseException as error:  # handed to the consumer, raised there
            _hand_over(ready, _Failure(error), stopped)
            return
        if not _hand_over(ready, made, stopped):
            return


class Prefetcher:
    """`make(batch)` for each batch of `source`, `depth` batches ahead.

    Args:
        source: the batches (read by the thread alone from now on).
        make: what to do to each batch (pad it, place it on the devices).
        depth: how many batches may wait at each stage (at least 1).
        name: the threads' names' start, for a stack dump.
    """

    def __init__(
        self,
        source: Iterator[Any],
        make: Callable[[Any], Any],
        depth: int,
        name: str = "keras_dist-prefetch",
    ):
        if depth < 1:
            raise ValueError(f"Prefetcher needs depth >= 1. Received: {depth}")
        self._read: queue.Queue = queue.Queue(maxsize=depth)
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._finished = False
        self._threads = (
            threading.Thread(
                target=_read,
                args=(iter(source), self._read, self._stopped),
                name=f"{name}-read",
                daemon=True,
            ),
            threading.Thread(
                target=_make,
                args=(make, self._read, self._ready, self._stopped),
                name=f"{name}-make",
                daemon=True,
            ),
        )
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        item = self._ready.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        return item

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads (idempotent); with `timeout`, wait that long for
        them to end (each ends at its next hand-over, or when the source's
        current batch is read)."""
        self._stopped.set()
        self._finished = True
        # Free the slots that blocked hand-overs wait for.
        for waiting in (self._read, self._ready):
            while True:
                try:
                    waiting.get_nowait()
                except queue.Empty:
                    break
        if timeout is not None:
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        """Whether either thread still runs."""
        return any(thread.is_alive() for thread in self._threads)

    def __del__(self) -> None:
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
