"""Distributed `tf.data` iterators are destroyed off the training thread.

Destroying a `tf.distribute` iterator joins the `tf.data` autotuning threads
of its per-device pipelines, and each of those may first finish waiting out
its current optimization period: on TensorFlow 2.21 that is often 2 s, 7 s,
17 s and up to over a minute (measured on CPU devices, with or without
autotuning on the input pipeline, read whole or not; longer on a busy
machine). Keras drops each epoch's iterator when it makes the next one, so
that wait fell between two epochs, on the thread that trains. TensorFlow
releases the GIL while it waits, so here the last reference is dropped by a
background thread instead: the epoch goes on at once.

An iterator is handed over with `adopt` when keras_dist makes it; the reaper
holds it until nothing else does (Keras dropped it), then destroys it on a
thread of its own. `collect` destroys at once the iterators Keras dropped:
the TensorFlow adapter calls it when a Keras call ends, so what a call made
is released with the call, not found later by the poll.

Exit: no destruction may still run once the interpreter shuts down. The last
step of destroying an iterator (freeing its functions' Python stack traces)
takes the GIL; a thread that asks for the GIL while the interpreter
finalizes is ended by `pthread_exit`, whose unwinding through TensorFlow's
`noexcept` C++ destructor aborts the process ("terminate called after
throwing an instance of ... FATAL: exception not rethrown", SIGABRT, exit
code 134) after the script itself succeeded. So `stop`, at exit, waits for
every destruction under way, up to `EXIT_WAIT_SECONDS` (a destruction that
outlives it is named on stderr). It starts none: the iterators still held
are left to the interpreter's teardown, which frees them on the main thread
(a destruction started at exit waited up to minutes for its autotuning
threads).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

POLL_SECONDS = 0.2
# TensorFlow's autotuning threads have been measured to take over a minute.
EXIT_WAIT_SECONDS = 180.0

# References `getrefcount` finds when nothing outside the reaper holds an
# iterator: the list's slot and `getrefcount`'s own argument.
_OURS = 2


class IteratorReaper:
    """Holds adopted iterators; destroys each once it is held only here."""

    def __init__(self) -> None:
        self._held: list[Any] = []
        # Guards `_held`, `_destroying` and `_stopping`; notified when a
        # destruction ends or the reaper stops.
        self._changed = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._destroying = 0

    def adopt(self, iterator: Any) -> Any:
        """Hold `iterator` until nothing else does; returns it."""
        with self._changed:
            if self._stopping:
                return iterator
            self._held.append(iterator)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keras_dist-tf-iterator-reaper", daemon=True
                )
                self._thread.start()
        return iterator

    def pending(self) -> int:
        """Iterators held or being destroyed."""
        with self._changed:
            return len(self._held) + self._destroying

    def collect(self) -> None:
        """Start destroying, now, every iterator nothing else holds."""
        with self._changed:
            released = self._take_released()
        self._destroy_each(released)

    def _take_released(self) -> list[Any]:
        """The held iterators nothing else holds, no longer held; each counts
        as being destroyed from now on (the caller holds `_changed`)."""
        free = [
            index
            for index in range(len(self._held))
            if sys.getrefcount(self._held[index]) <= _OURS
        ]
        released = [self._held[index] for index in free]
        for index in reversed(free):
            del self._held[index]
        self._destroying += len(released)
        return released

    def _destroy_each(self, released: list[Any]) -> None:
        while released:
            # One thread each: a destruction can wait a minute, and the next
            # iterator must not wait behind it.
            threading.Thread(
                target=self._destroy,
                args=([released.pop()],),
                name="keras_dist-tf-iterator-reaper-destroy",
                daemon=True,
            ).start()

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopping:
                    return
                released = self._take_released()
            self._destroy_each(released)
            with self._changed:
                self._changed.wait_for(lambda: self._stopping, POLL_SECONDS)

    def _destroy(self, box: list[Any]) -> None:
        """Runs on its own thread, which drops the last reference (`box`
        holds it, so that `threading.Thread`'s arguments do not)."""
        try:
            box.clear()
        finally:
            with self._changed:
                self._destroying -= 1
                self._changed.notify_all()

    def stop(self, timeout_seconds: float = EXIT_WAIT_SECONDS) -> None:
        """Stop adopting and destroying; wait (bounded) until no destruction
        runs. Called at exit: the iterators still held are left to the
        interpreter's own teardown, on the main thread (destroying one now
        could wait minutes for its autotuning threads)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        deadline = time.monotonic() + timeout_seconds
        with self._changed:
            ended = self._changed.wait_for(
                lambda: self._destroying == 0, max(0.0, deadline - time.monotonic())
            )
            running = self._destroying
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if not ended:
            print(
                f"keras_dist: {running} TensorFlow iterator(s) still being "
                f"destroyed after {timeout_seconds:.0f} s at exit (tf.data's "
                "autotuning threads); the interpreter may abort as it shuts "
                "down.",
                file=sys.stderr,
                flush=True,
            )


REAPER = IteratorReaper()
atexit.register(REAPER.stop)
