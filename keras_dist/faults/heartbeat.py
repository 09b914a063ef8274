"""Each process' heartbeat, and the watchdog that acts when the job hangs.

The main thread only sets a few attributes at the edges of keras_dist's work:
`DistributeCallback` marks each Keras call's begin and end and wraps the call's
step function (phase `step` inside it, `callback` between steps), the routed
batches mark `data` while a batch is read (on PyTorch, where Keras reads the
batch between steps; JAX and TensorFlow read it inside the step function, so
there a stuck read shows as `step`), and `keras_dist.saving` marks `save`. A
daemon thread (`keras-dist-heartbeat`) writes the heartbeat file at most once a
second when something changed, so a step costs no file write.

Where the heartbeats live:

- under `keras-dist launch` (`KERAS_DIST_JOB_DIR` set): in the job directory;
  the launcher reads them, writes the dump request when a rank stalls, prints
  the summary and ends the job (`keras_dist.faults.hang_doctor`);
- otherwise (torchrun, SLURM, Ray): in a directory of the temp dir named after
  the job's coordinator address, shared by the ranks of one node. Each rank's
  watchdog reads those, and when a rank stalls, dumps its own stacks, waits
  for its peers' dumps, lets the lowest rank print the summary, and exits with
  `HANG_EXIT_CODE`, so that the launcher (torchrun, srun) ends the job. On
  several nodes each node sees only its ranks: a node whose ranks all wait in
  a step reports that the rank behind is elsewhere, and the node holding it
  names it.

The watchdog is a Python thread: it runs while the main thread is blocked in
C++ (collectives release the GIL) and dumps every thread with `faulthandler`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from keras_dist.cluster import hang_doctor
from keras_dist.cluster.job_dir import JOB_DIRECTORY_VARIABLE, job_paths
from keras_dist.common import job
from keras_dist.faults import lifecycle

# How often the watchdog wakes: to notice a dump request, or a stall.
_TICK_SECONDS = 0.25
# At most one heartbeat write per this many seconds.
_WRITE_INTERVAL_SECONDS = 1.0
# Under the launcher, a rank that dumped ends itself this long after, in case
# the launcher's SIGTERM cannot reach its blocked main thread.
_EXIT_AFTER_DUMP_SECONDS = 3.0
# torch's Flight Recorder keeps this many collectives (when torch reads the
# variable, before its process group starts).
_FLIGHT_RECORDER_ENTRIES = "2000"
_MODES = {"train": "fit", "test": "evaluate", "predict": "predict"}
# The temp dir the ranks of a node share, read before `initialize` gives each
# rank a temporary directory of its own (`keras_dist.faults.lifecycle`).
_NODE_TEMPORARY_DIRECTORY = tempfile.gettempdir()


class _Beat:
    """What the main thread marks; the watchdog reads it (a torn read only
    mixes two consecutive states)."""

    __slots__ = ("advanced", "call", "epoch", "mode", "phase", "progress", "step")

    def __init__(self) -> None:
        self.call = 0
        self.mode: str | None = None
        self.epoch: int | None = None
        self.step = 0
        self.phase = "outside"
        # Goes up at every call begin and end and every step begin and end:
        # every rank runs them in the same order, so it orders the ranks.
        self.progress = 0
        self.advanced = time.monotonic()

    def snapshot(self) -> tuple:
        return (
            self.call,
            self.mode,
            self.epoch,
            self.step,
            self.phase,
            self.progress,
            self.advanced,
        )


_beat = _Beat()
# One frame per Keras call in progress (validation runs inside `fit`):
# (model, function name, wrapper, original function, mode, epoch, step).
_frames: list[tuple] = []
_configured: list[float] = []
_watchdog: list[_Watchdog] = []


def configure(hang_timeout: float | None) -> float:
    """Set this process' hang timeout (`keras_dist.initialize(hang_timeout=)`);
    None: `KERAS_DIST_HANG_TIMEOUT`, else 1800 s. Returns the seconds.

    Raises:
        TypeError, ValueError: naming a value that is not a number >= 0.
    """
    if hang_timeout is None:
        seconds = hang_doctor.hang_timeout_from_environment()
    else:
        seconds = hang_doctor.check_hang_timeout(hang_timeout)
    _configured[:] = [seconds]
    if seconds > 0:
        # torch reads it when its process group starts: what `initialize`
        # does next. Harmless on the other backends.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", _FLIGHT_RECORDER_ENTRIES)
    return seconds


def hang_timeout() -> float:
    """This process' hang timeout in seconds (0: the hang doctor is off)."""
    return _configured[0] if _configured else configure(None)


# -- marks (main thread) -------------------------------------------------------
def _mark(phase: str) -> None:
    _beat.phase = phase
    _beat.advanced = time.monotonic()


def begin_call(model: Any, mode: str) -> None:
    """A Keras `fit` (`"train"`), `evaluate` or `predict` of `model` begins:
    its step function (made by Keras just before) is watched until
    `end_call`."""
    name = f"{mode}_function"
    original = model.__dict__.get(name)
    wrapper = None
    # Steps are watched only when a watchdog reads the marks (several
    # processes, the hang doctor on): one process' steps stay Keras' own.
    if original is not None and _watchdog:
        wrapper = _watched_step(original)
        setattr(model, name, wrapper)
    outer = (_beat.mode, _beat.epoch, _beat.step)
    _frames.append((model, name, wrapper, original, *outer))
    _beat.call += 1
    _beat.mode = _MODES.get(mode, mode)
    _beat.epoch = None
    _beat.step = 0
    _beat.progress += 1
    _mark("callback")


def end_call(model: Any) -> None:
    """The innermost watched call of `model` ended."""
    for index in range(len(_frames) - 1, -1, -1):
        if _frames[index][0] is model:
            _pop_frame(index)
            return


def end_calls(model: Any) -> None:
    """Every watched call of `model` ended (its run stopped, maybe raising)."""
    for index in range(len(_frames) - 1, -1, -1):
        if _frames[index][0] is model:
            _pop_frame(index)


def _pop_frame(index: int) -> None:
    model, name, wrapper, original, mode, epoch, step = _frames.pop(index)
    if wrapper is not None and model.__dict__.get(name) is wrapper:
        setattr(model, name, original)
    _beat.mode, _beat.epoch, _beat.step = mode, epoch, step
    _beat.progress += 1
    _mark("callback" if _frames else "outside")


def begin_epoch(epoch: int) -> None:
    _beat.epoch = epoch


# One wrapper per step function, so that a step Keras reuses from call to call
# stays the same object inside every call, as it is without keras_dist.
_wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _watched_step(function: Callable[..., Any]) -> Callable[..., Any]:
    with contextlib.suppress(KeyError, TypeError):  # TypeError: no weakref
        return _wrappers[function]
    wrapper = _new_watched_step(function)
    with contextlib.suppress(TypeError):
        _wrappers[function] = wrapper
    return wrapper


def _new_watched_step(function: Callable[..., Any]) -> Callable[..., Any]:
    beat = _beat

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        beat.progress += 1
        beat.phase = "step"
        beat.advanced = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            beat.step += 1
            beat.progress += 1
            beat.phase = "callback"
            beat.advanced = time.monotonic()

    return watched_step


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Inside: this process is in phase `name` (`"save"`); then back to the
    phase it was in. Outside any watched call, nothing is marked."""
    previous = _beat.phase
    if previous == "outside":
        yield
        return
    _mark(name)
    try:
        yield
    finally:
        _mark(previous)


def watching_batches(
    source: Callable[..., Any],
) -> Callable[..., Iterator[Any]]:
    """`source` (a function returning an epoch's batches), whose batches mark
    the phase `data` while each is read."""

    if not _watchdog:
        # Nobody reads the marks (one process, or the hang doctor off).
        return source

    def batches(*args: Any, **kwargs: Any) -> Iterator[Any]:
        # `iter` now, as Keras would: making the iterator may draw the
        # epoch's shuffle, which must happen when it happens without this.
        return _read_marked(iter(source(*args, **kwargs)))

    return batches


def _read_marked(iterator: Iterator[Any]) -> Iterator[Any]:
    while True:
        previous = _beat.phase
        _mark("data")
        try:
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            _mark(previous)
        yield batch


# -- the watchdog ----------------------------------------------------------------
def start(
    *, rank: int, world_size: int, collective_trace: Callable[[], str | None]
) -> None:
    """Start this process' heartbeat and watchdog (idempotent): only in a job
    of several processes, with the hang doctor on.

    Args:
        rank: this process' rank.
        world_size: the job's process count.
        collective_trace: returns the backend's account of this process'
            latest collectives for the dump, or None.
    """
    if _watchdog or hang_timeout() == 0 or world_size == 1:
        return
    job_directory = os.environ.get(JOB_DIRECTORY_VARIABLE)
    watchdog = _Watchdog(
        rank=rank,
        world_size=world_size,
        directory=job_directory or _node_directory(),
        under_launcher=bool(job_directory),
        collective_trace=collective_trace,
    )
    _watchdog.append(watchdog)
    watchdog.start()


def _node_directory() -> str:
    """Where the ranks of this node keep their heartbeats without a launcher:
    named after the job (its coordinator, and the scheduler's job id)."""
    # The address every rank joined (what `initialize` recorded), else torch's.
    coordinator = job.joined().get("coordinator") or "{}:{}".format(
        os.environ.get("MASTER_ADDR", "local"), os.environ.get("MASTER_PORT", "0")
    )
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{coordinator}-{job_id}")
    _remove_stale_node_directories()
    directory = os.path.join(_NODE_TEMPORARY_DIRECTORY, f"{_NODE_PREFIX}{name}")
    os.makedirs(directory, exist_ok=True)
    return directory


_NODE_PREFIX = "keras_dist_heartbeats_"


def _remove_stale_node_directories() -> None:
    """Remove the heartbeats that ranks killed outright (SIGKILL, `os._exit`)
    left in the node's temp dir, and their directories once empty."""
    with contextlib.suppress(OSError):
        for name in os.listdir(_NODE_TEMPORARY_DIRECTORY):
            if not name.startswith(_NODE_PREFIX):
                continue
            directory = os.path.join(_NODE_TEMPORARY_DIRECTORY, name)
            with contextlib.suppress(OSError):
                for entry in os.listdir(directory):
                    path = os.path.join(directory, entry)
                    beat = hang_doctor.read_heartbeat(path)
                    pid = beat.get("pid") if beat else None
                    if isinstance(pid, int) and not lifecycle.is_alive(pid):
                        os.remove(path)
                os.rmdir(directory)  # fails while a live rank's file is there


class _Watchdog(threading.Thread):
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        directory: str,
        under_launcher: bool,
        collective_trace: Callable[[], str | None],
    ) -> None:
        super().__init__(name="keras-dist-heartbeat", daemon=True)
        self.rank = rank
        self.world_size = world_size
        self.directory = directory
        self.path = job_paths(directory, rank).heartbeat_file
        self.under_launcher = under_launcher
        self.collective_trace = collective_trace
        self.dumped = False
        self._written: tuple | None = None
        self._written_at = 0.0
        if not under_launcher:
            # A normal exit runs `atexit`; lifecycle's ends (an exception, a
            # signal, `end_now`) skip it and run `call_at_end`.
            atexit.register(self._remove)
            lifecycle.call_at_end(self._remove)

    def beat(self) -> dict:
        call, mode, epoch, step, phase_, progress, advanced = _beat.snapshot()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "call": call,
            "mode": mode,
            "epoch": epoch,
            "step": step,
            "phase": phase_,
            "progress": progress,
            # Wall clock: the launcher and the other ranks compare it.
            "advanced_at": time.time() - (time.monotonic() - advanced),
            "hang_timeout": hang_timeout(),
            "dumped": self.dumped,
        }

    def write(self, force: bool = False) -> None:
        state = (_beat.snapshot(), self.dumped)
        now = time.monotonic()
        if not force and (
            state == self._written or now - self._written_at < _WRITE_INTERVAL_SECONDS
        ):
            return
        try:
            hang_doctor.write_heartbeat(self.path, self.beat())
        except OSError:
            # The job directory is gone: the launcher is ending the job.
            return
        self._written, self._written_at = state, now

    def run(self) -> None:
        self.write(force=True)
        request = hang_doctor.dump_request_file(self.directory)
        while True:
            time.sleep(_TICK_SECONDS)
            self.write()
            if self.under_launcher:
                if os.path.exists(request):
                    lifecycle.announce_end(
                        hang_doctor.HANG_EXIT_CODE, _EXIT_AFTER_DUMP_SECONDS + 10
                    )
                    self.dump()
                    time.sleep(_EXIT_AFTER_DUMP_SECONDS)
                    lifecycle.end_now(hang_doctor.HANG_EXIT_CODE)
                    return  # another thread is ending the process
            elif hang_doctor.stalled(self.peers(), time.time()):
                self.end_job()
                return  # another thread is ending the process

    def peers(self) -> list[dict]:
        """The heartbeats of the live ranks of this job on this node."""
        beats = []
        for rank in range(self.world_size):
            path = job_paths(self.directory, rank).heartbeat_file
            beat = self.beat() if rank == self.rank else None
            if beat is None:
                beat = hang_doctor.read_heartbeat(path)
            if beat is not None and lifecycle.is_alive(int(beat.get("pid", 0))):
                beats.append(beat)
        return beats

    def end_job(self) -> None:
        before = self.peers()  # dumping is not progress: report what stalled
        # The first rank to finish ends, and a peer's collective then fails.
        lifecycle.announce_end(
            hang_doctor.HANG_EXIT_CODE, hang_doctor.DUMP_WAIT_SECONDS + 10
        )
        self.dump()
        hang_doctor.wait_for_dumps(self.peers)
        if self.rank == min(beat["rank"] for beat in before):
            report = hang_doctor.summary(
                before, time.time(), world_size=self.world_size
            )
            _print(f"keras-dist: {report}\nkeras-dist: ending this job")
        # Removes this rank's temporaries and its heartbeat (`call_at_end`).
        lifecycle.end_now(hang_doctor.HANG_EXIT_CODE)

    def dump(self) -> None:
        """Print this process' Python stacks (every thread) and collective
        trace to stderr, then say so in the heartbeat."""
        if self.dumped:
            return
        label = f"keras-dist: hang doctor: rank {self.rank}"
        where = hang_doctor.describe(self.beat(), time.time())
        _print(f"keras-dist: hang doctor: {where}")
        _print(f"{label}: Python stacks of every thread, most recent call first:")
        faulthandler.dump_traceback(file=_stderr(), all_threads=True)
        try:
            trace = self.collective_trace()
        except Exception as error:  # a dump must never stop the report
            trace = f"could not be read: {type(error).__name__}: {error}"
        if trace is None:
            trace = "none: this backend keeps no trace of its collectives"
        _print(f"{label}: collective trace: {trace}")
        self.dumped = True
        self.write(force=True)

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)  # the last rank of the node removes it


def _stderr() -> Any:
    """A stream with a file descriptor, as `faulthandler` needs."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
    return sys.stderr


def _print(text: str) -> None:
    stream = _stderr()
    stream.write(text + "\n")
    stream.flush()
