"""Preemption: a SIGTERM or SIGUSR1 to any process makes every process save
at one agreed step, then exit with `PREEMPTED_EXIT_CODE`.

The signalled process writes a request into the checkpoint directory (which
every process sees): the step it has just finished plus a margin. Synchronous
data parallelism keeps the processes within a step or two of each other (a
step's collectives need all of them), so each one reads the request before it
reaches that step, checking after every batch. All save there, process 0
commits, every process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from keras_dist.cluster.job_dir import PREEMPTED_EXIT_CODE
from keras_dist.faults import lifecycle

REQUEST = ".keras_dist-preemption.json"
# Steps between the step a signalled process has finished and the step every
# process saves at.
MARGIN_STEPS = 4

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption"]


class Preemption:
    """One `fit`'s watch for preemption signals.

    Args:
        directory: the checkpoint directory (every process sees it).
        rank: this process' rank; `processes`: how many the job has.
    """

    def __init__(self, directory: str, rank: int, processes: int) -> None:
        self.path = os.path.join(directory, REQUEST)
        self.rank = rank
        self.processes = processes
        self.signal: int | None = None
        self.started = time.time()
        self._agreed: int | None = None
        self._undo: list[Callable[[], None]] = []

    def start(self) -> None:
        """Watch SIGTERM and SIGUSR1 until `stop`."""
        self.started = time.time()
        if lifecycle._installed:  # a multi-process job: its watcher forwards
            self._undo.append(lifecycle.on_preemption(self._signalled))
        elif threading.current_thread() is threading.main_thread():
            for signum in lifecycle.PREEMPTION_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN:
                    continue
                signal.signal(signum, lambda number, frame: self._signalled(number))
                self._undo.append(
                    lambda signum=signum, previous=previous: signal.signal(
                        signum, previous
                    )
                )
        if self.rank == 0:
            self._remove_stale_request()

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _signalled(self, signum: int) -> None:
        if self.signal is None:
            self.signal = signum

    def _remove_stale_request(self) -> None:
        request = self._read()
        if request is not None and request.get("time", 0) < self.started:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def _read(self) -> dict[str, Any] | None:
        try:
            with open(self.path, encoding="utf-8") as file:
                return json.load(file)
        except (OSError, ValueError):
            return None

    def agreed_step(self, finished_step: int) -> int | None:
        """After each batch: the step every process saves at and exits after,
        once any process was signalled; None until then."""
        if self._agreed is not None:
            return self._agreed
        if self.signal is not None and self.processes == 1:
            self._agreed = finished_step
            return self._agreed
        if self.signal is not None:
            self._request(finished_step + MARGIN_STEPS)
        request = self._read()
        if request is None or request.get("time", 0) < self.started:
            return None
        self._agreed = int(request["step"])
        if self._agreed < finished_step:
            raise RuntimeError(
                f"Rank {self.rank} read the preemption request of rank "
                f"{request.get('rank')} (save at step {self._agreed}) only after "
                f"step {finished_step}: the processes drifted more than "
                f"{MARGIN_STEPS} steps apart, so they cannot save at one step."
            )
        return self._agreed

    def _request(self, step: int) -> None:
        """Write the request unless another process already did (the first
        request wins: the file is created exclusively)."""
        content = json.dumps(
            {
                "step": step,
                "rank": self.rank,
                "signal": self.signal,
                "time": time.time(),
            }
        )
        partial = f"{self.path}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as file:
            file.write(content)
        try:
            os.link(partial, self.path)  # fails when a request exists
        except FileExistsError:
            existing = self._read()
            if existing is not None and existing.get("time", 0) < self.started:
                os.replace(partial, self.path)  # a stale one from an earlier run
                return
        finally:
            with contextlib.suppress(OSError):
                os.remove(partial)

    def finish(self) -> None:
        """Process 0, once the agreed checkpoint is committed: remove the
        request, so that the resumed job does not take it for a new one."""
        if self.rank == 0:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def describe(self) -> str:
        name = signal.Signals(self.signal).name if self.signal else "a peer's signal"
        return name
