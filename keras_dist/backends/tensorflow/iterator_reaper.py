"""Distributed `tf.data` iterators are destroyed off the training thread.

Destroying a `tf.distribute` iterator joins the `tf.data` autotuning threads
of its per-device pipelines, and each of those may first finish waiting out
its current optimization period: on TensorFlow 2.21 that is often 2 s, 7 s,
17 s and up to over a minute (measured on CPU devices, with or without
autotuning on the input pipeline, read whole or not). Keras drops each
epoch's iterator when it makes the next one, so that wait fell between two
epochs, on the thread that trains. TensorFlow releases the GIL while it
waits, so here the last reference is dropped by a background thread instead:
the epoch goes on at once.

An iterator is handed over with `adopt` when keras_dist makes it; the reaper
holds it until nothing else does (Keras dropped it), then destroys it. At
exit, a destruction under way is given `EXIT_WAIT_SECONDS` to finish; the
iterators not yet destroyed are left to TensorFlow's own teardown, as before.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

POLL_SECONDS = 0.2
EXIT_WAIT_SECONDS = 10.0

# References `getrefcount` finds when nothing outside the reaper holds an
# iterator: the list's slot and `getrefcount`'s own argument.
_OURS = 2


class IteratorReaper:
    """Holds adopted iterators; destroys each once it is held only here."""

    def __init__(self) -> None:
        self._held: list[Any] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._destroying = 0
        self._done = threading.Event()

    def adopt(self, iterator: Any) -> Any:
        """Hold `iterator` until nothing else does; returns it."""
        with self._lock:
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
        """Iterators held and not yet destroyed."""
        with self._lock:
            return len(self._held)

    def _take_released(self) -> list[Any]:
        with self._lock:
            free = [
                index
                for index in range(len(self._held))
                if sys.getrefcount(self._held[index]) <= _OURS
            ]
            released = [self._held[index] for index in free]
            for index in reversed(free):
                del self._held[index]
            if released:
                self._idle.clear()
            return released

    def _run(self) -> None:
        while not self._stopping:
            released = self._take_released()
            while released:
                # One thread each: a destruction can wait a minute, and the
                # next iterator must not wait behind it.
                thread = threading.Thread(
                    target=self._destroy,
                    args=([released.pop()],),
                    name="keras_dist-tf-iterator-reaper-destroy",
                    daemon=True,
                )
                with self._lock:
                    self._destroying += 1
                thread.start()
                del thread
            self._idle.set()
            time.sleep(POLL_SECONDS)

    def _destroy(self, box: list[Any]) -> None:
        """Runs on its own thread, which drops the last reference (`box`
        holds it, so that `threading.Thread`'s arguments do not)."""
        box.clear()
        with self._lock:
            self._destroying -= 1
            if self._destroying == 0:
                self._done.set()

    def stop(self, timeout_seconds: float = EXIT_WAIT_SECONDS) -> None:
        """Stop adopting; wait (bounded) for destructions under way."""
        with self._lock:
            self._stopping = True
            if self._destroying == 0:
                self._done.set()
            else:
                self._done.clear()
        self._idle.wait(timeout_seconds)
        self._done.wait(timeout_seconds)


REAPER = IteratorReaper()
atexit.register(REAPER.stop)
