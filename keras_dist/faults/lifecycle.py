"""How a rank of a multi-process job ends: fast, said once, and clean.

`keras_dist.initialize()` calls `install` once the job has several processes.
From then on:

- An uncaught exception writes an error report (rank, exception type,
  message, traceback, wall-clock time) to the rank's `error_file` in the
  launcher's job directory (`KERAS_DIST_JOB_DIR`) and, under torchrun, to
  `TORCHELASTIC_ERROR_FILE` in torchelastic's format; prints the traceback
  as Python does; removes the rank's temporary files; SIGTERMs the processes
  it started (its process group, when it leads one); and ends the process at
  once with exit code 1 (`end_now`). Ending at once skips the interpreter's
  shutdown:
  `atexit` handlers (among them `jax.distributed`'s shutdown barrier, which
  waits up to 5 minutes for ranks that are still in a collective, and gloo's
  teardown), finalizers of objects still alive, and the buffers of files the
  script left open (stdout, stderr and `logging` are flushed first).
- SIGTERM and SIGINT end the rank within milliseconds even when its main
  thread waits in a C++ collective: the signal wakes a watcher thread
  (`signal.set_wakeup_fd`; a Python handler alone runs only between the main
  thread's bytecodes), which removes the temporary files and ends the
  process, and its process group when it leads one, with that signal (so the
  launcher reports the signal). Backends replace Python's SIGTERM handler
  when they start (JAX's and TensorFlow's coordination service records the
  signal for preemption and otherwise ignores it); `install` runs after them.
  `stop` is the one place a stop signal is handled.
- A rank started by `keras-dist launch` (or torchrun) stops when its launcher
  dies, even by SIGKILL: the launcher asks the kernel for a parent-death
  signal, and the watcher also checks the parent twice a second.
- Temporary files: under `keras-dist launch` every rank's `TMPDIR` is inside
  the job directory, which the launcher removes; otherwise (torchrun, SLURM)
  `install` gives the rank a temporary directory of its own
  (`keras_dist_rank<N>_*`) and removes it when the process ends, however it
  ends short of SIGKILL. Files an unfinished save writes next to its target
  are removed too (`removed_if_stopped`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType

from keras_dist.cluster.job_dir import (
    JOB_DIRECTORY_VARIABLE,
    LAUNCHER_PID_VARIABLE,
    job_paths,
)
from keras_dist.faults.own_failure import ended_peers, is_own_failure

TORCHELASTIC_ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Signals a preemption handler (`on_preemption`) may turn into "save, then
# stop": SIGTERM (SLURM, Kubernetes, `keras-dist launch`) and SIGUSR1
# (`sbatch --signal`). SIGINT (Ctrl-C) always stops at once.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTION_GRACE_VARIABLE = "KERAS_DIST_PREEMPTION_GRACE"
DEFAULT_PREEMPTION_GRACE_SECONDS = 120.0
# How often the watcher checks that the launcher still runs (the parent-death
# signal normally tells it at once; this is the portable fallback).
_PARENT_CHECK_SECONDS = 0.5
# The kernel's flag of a process being ended (include/linux/sched.h).
_PF_EXITING = 0x4
# A rank's own temporary directory: keras_dist_rank<rank>_<pid>_<random>.
_OWN_PREFIX = "keras_dist_rank"

_installed: dict[str, object] = {}
# Files and directories to remove if the process is stopped before the code
# that owns them finished (see `removed_if_stopped`).
_temporaries: set[str] = set()
# Called when this module ends the process (see `call_at_end`).
_at_end: list[Callable[[], object]] = []
# Whoever ends the process holds it: the excepthook or the watcher, not both.
_ending = threading.Lock()
# Set by `announce_end`: the exit code this rank is about to end with, and
# the monotonic time by which it will have ended.
_announced: dict[str, float] = {}
# `on_preemption` handlers, newest last; the grace timer once one ran.
_preemption_handlers: list[Callable[[int], object]] = []
_grace_timer: list[threading.Timer] = []


def install(rank: int) -> None:
    """End this rank promptly and cleanly on a failure or a stop signal.

    Call once the backend joined the job (it may install signal handlers of
    its own). Idempotent. Signal handling needs the main thread; called from
    another thread, only the excepthook and the launcher check are installed.

    Args:
        rank: this process' rank, written into its error report.

    Example:

    >>> keras_dist.faults.lifecycle.install(rank=0)
    """
    if _installed:
        return
    job_directory = os.environ.get(JOB_DIRECTORY_VARIABLE) or None
    _installed.update(
        rank=rank,
        job_directory=job_directory,
        parent=_parent_to_watch(),
        own_temporary_directory=None,
    )
    if job_directory is None:
        _installed["own_temporary_directory"] = _use_own_temporary_directory(rank)
    sys.excepthook = _ExceptHook(sys.excepthook)
    wakeup = None
    if threading.current_thread() is threading.main_thread():
        wakeup = _watch_stop_signals()
    threading.Thread(
        target=_watch, args=(wakeup,), name="keras-dist-lifecycle", daemon=True
    ).start()


@contextlib.contextmanager
def removed_if_stopped(path: str) -> Iterator[str]:
    """Remove `path` (a file or a directory) if this process is ended (a
    stop signal, `end_now`) while the block runs, which skips the block's
    `finally`. An exception raised inside leaves the block as usual, so the
    code around it decides what to remove.

    Example:

    >>> with removed_if_stopped(temporary):
    ...     write(temporary)
    ...     os.replace(temporary, final)
    """
    _temporaries.add(path)
    try:
        yield path
    finally:
        _temporaries.discard(path)


def call_at_end(function: Callable[[], object]) -> None:
    """Have `function` called (without arguments, its errors ignored, last
    registered first) when this module ends the process: an uncaught
    exception, SIGTERM/SIGINT, `end_now`. Those skip `atexit`, which a normal
    exit runs; register clean-up with both. It may run in any thread.

    Example:

    >>> call_at_end(lambda: os.remove(heartbeat_file))
    """
    _at_end.append(function)


def on_preemption(handler: Callable[[int], object]) -> Callable[[], None]:
    """While registered, SIGTERM and SIGUSR1 call `handler(signum)` (from the
    watcher thread) instead of ending the process: the handler arranges a
    save and the end (`kd.Checkpoint`). The process still ends by the signal
    `KERAS_DIST_PREEMPTION_GRACE` seconds (120 by default) after the first
    one, saved or not; SIGINT and the launcher's death end it at once.
    Returns the function that unregisters the handler.

    Example:

    >>> remove = on_preemption(lambda signum: request.set())
    """
    _preemption_handlers.append(handler)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _preemption_handlers.remove(handler)

    return remove


def preemption_grace_seconds() -> float:
    raw = os.environ.get(PREEMPTION_GRACE_VARIABLE, "")
    if not raw.strip():
        return DEFAULT_PREEMPTION_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{PREEMPTION_GRACE_VARIABLE} must be a positive number of seconds. "
            f"Received: {raw!r}"
        )
    return value


def stop(signum: int) -> None:
    """End this rank as a stop signal asks: remove its temporary files, flush
    its output, SIGTERM the processes it started (when it leads its process
    group), then end the process with `signum`, so that whoever started it
    sees that signal. SIGTERM and
    SIGUSR1 go to the preemption handler instead while one is registered
    (`on_preemption`).

    The one place SIGTERM, SIGINT and SIGUSR1 are handled once `install` ran;
    it may run in any thread and returns only when another thread is already
    ending the process (or a preemption handler took the signal).
    """
    if signum in PREEMPTION_SIGNALS and _preemption_handlers:
        if not _grace_timer:
            timer = threading.Timer(
                preemption_grace_seconds(), _stop_now, args=(signum,)
            )
            timer.daemon = True
            _grace_timer.append(timer)
            timer.start()
        _preemption_handlers[-1](signum)
        return
    _stop_now(signum)


def _stop_now(signum: int) -> None:
    """`stop` without asking a preemption handler."""
    if not _ending.acquire(blocking=False):
        return
    _clean_up()
    _flush_output()
    _end_by_signal(signum)


def end_now(exit_code: int) -> None:
    """End this rank at once with `exit_code`, from any thread: remove its
    temporary files, flush its output, SIGTERM the processes it started (when
    it leads its process group), then `os._exit` (no `atexit` handlers, so no
    barrier to wait in). Returns only when another thread is already ending
    the process.

    Example:

    >>> end_now(124)  # a watchdog found this rank hung
    """
    if not _ending.acquire(blocking=False):
        return
    _end(exit_code)


def announce_end(exit_code: int, within: float) -> None:
    """Say that this rank will end with `exit_code` within `within` seconds
    (a watchdog that found the job hung, while it still gathers its report).

    Meanwhile its peers end, so a collective the main thread waits in fails
    ("connection closed by peer"): that exception is a consequence, not the
    cause. The excepthook then prints one line instead of an error report,
    waits for the announcer to end the process, and ends it with
    `exit_code` itself only if the announcer has not done so in time.
    """
    _announced["exit_code"] = exit_code
    _announced["deadline"] = time.monotonic() + within


def _end(exit_code: int) -> None:
    """`end_now` once `_ending` is held."""
    try:
        _clean_up()
        _flush_output()
        _stop_process_group()
        _remove_unfinished_saves()
    finally:
        os._exit(exit_code)


class _ExceptHook:
    """`sys.excepthook`: report, print, clean up, end the process at once."""

    def __init__(self, previous: Callable[..., object]) -> None:
        self.previous = previous

    def __call__(
        self,
        exception_type: type[BaseException],
        exception: BaseException,
        trace: TracebackType | None,
    ) -> None:
        # An interactive interpreter calls the hook for every failed line.
        if sys.flags.interactive or hasattr(sys, "ps1"):
            self.previous(exception_type, exception, trace)
            return
        if _announced:
            self._end_as_announced(exception_type, exception)
            return
        if not _ending.acquire(blocking=False):
            return  # a stop signal is already ending the process
        try:
            _write_reports(exception_type, exception, trace)
            self.previous(exception_type, exception, trace)
        finally:
            _end(1)

    @staticmethod
    def _end_as_announced(
        exception_type: type[BaseException], exception: BaseException
    ) -> None:
        exit_code = int(_announced["exit_code"])
        rank = _installed.get("rank", "?")
        print(
            f"keras-dist: rank {rank}: {exception_type.__name__}: {exception} "
            f"(raised while this rank ends with exit code {exit_code}; a "
            "consequence of that, not its cause)",
            file=sys.stderr,
            flush=True,
        )
        while time.monotonic() < _announced["deadline"]:
            time.sleep(0.05)  # the announcer ends the process meanwhile
        if _ending.acquire(blocking=False):
            _end(exit_code)


def error_report(
    rank: int,
    exception_type: type[BaseException],
    exception: BaseException,
    trace: TracebackType | None,
) -> dict[str, object]:
    """What `keras-dist launch` reads from a rank's `error_file` (JSON)."""
    # First: whether other ranks had ended when the exception came here.
    peers = ended_peers(_installed.get("job_directory"), rank, _is_running)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "type": exception_type.__qualname__,
        "message": str(exception),
        "traceback": "".join(
            traceback.format_exception(exception_type, exception, trace)
        ),
        # Wall clock: the launcher compares the ranks' reports by it.
        "timestamp": time.time(),
        # Not another rank's failure's consequence (`own_failure`).
        "on_its_own": is_own_failure(exception, peers),
    }


def _write_reports(
    exception_type: type[BaseException],
    exception: BaseException,
    trace: TracebackType | None,
) -> None:
    report = error_report(_installed["rank"], exception_type, exception, trace)
    job_directory = _installed["job_directory"]
    if job_directory is not None:
        _write_json(job_paths(job_directory, report["rank"]).error_file, report)
    torchelastic_file = os.environ.get(TORCHELASTIC_ERROR_FILE_VARIABLE)
    if torchelastic_file:
        # The format of torch.distributed.elastic's `ErrorHandler`, so that
        # torchrun names the exception as it does for `@record`.
        _write_json(
            torchelastic_file,
            {
                "message": {
                    "message": f"{report['type']}: {report['message']}",
                    "extraInfo": {
                        "py_callstack": report["traceback"],
                        "timestamp": str(int(report["timestamp"])),
                    },
                }
            },
        )


def _write_json(path: str, content: dict) -> None:
    # Complete or absent: the launcher may read it at any moment.
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as file:
            json.dump(content, file)
        os.replace(temporary, path)
    except OSError:
        # The job directory is gone (the launcher ended): nobody reads it.
        with contextlib.suppress(OSError):
            os.remove(temporary)


def _parent_to_watch() -> int | None:
    """The launcher's pid when one started this rank and this rank should end
    with it; None for a rank started by hand (its parent may be a shell that
    exits while training goes on)."""
    raw = os.environ.get(LAUNCHER_PID_VARIABLE, "")
    if raw.isdigit():
        launcher = int(raw)
        if os.getppid() == launcher or not is_alive(launcher):
            return launcher
        # A process a rank started inherits the variable; its parent is the
        # rank, which ends it itself.
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.getppid()
    return None


def is_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (another
    user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_running(pid: int) -> bool:
    """Alive and not exiting: a process whose main thread ended (a zombie) or
    that the kernel is ending is on its way out (Linux tells; elsewhere, alive
    is running)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            # State, ppid, pgrp, session, tty_nr, tpgid, flags, ...
            fields = file.read().rpartition(")")[2].split()
        state, flags = fields[0], int(fields[6])
    except FileNotFoundError:
        # No such process; or no /proc (macOS): then ask the kernel.
        return not os.path.isdir("/proc/self") and is_alive(pid)
    except (OSError, IndexError, ValueError):
        return is_alive(pid)
    # PF_EXITING is set first thing as a process ends, before it closes its
    # files: its state stays "R" for milliseconds after its peers saw its
    # sockets close (measured under load with SIGKILL and `os._exit`).
    return state not in ("Z", "X") and not flags & _PF_EXITING


def _use_own_temporary_directory(rank: int) -> str:
    """A temporary directory for this rank, removed when it ends; Python's
    `tempfile` (so Keras and keras_dist) and child processes write there.

    Its name carries the pid: those of ranks that could not remove theirs
    (SIGKILL, `os._exit`) are removed here, once their process is gone."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name.split("_")[3] if name.count("_") >= 4 else ""
            if (
                name.startswith(_OWN_PREFIX)
                and pid.isdigit()
                and not is_alive(int(pid))
            ):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    directory = tempfile.mkdtemp(prefix=f"{_OWN_PREFIX}{rank}_{os.getpid()}_")
    tempfile.tempdir = directory
    os.environ["TMPDIR"] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _watch_stop_signals() -> int:
    """Handle SIGTERM and SIGINT in Python again, and have them wake the
    watcher thread through a pipe; returns the pipe's reading end."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    for signum in STOP_SIGNALS:
        # A signal the process was started ignoring stays ignored (a shell's
        # background job ignores SIGINT, `nohup`...), as Python itself does.
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _note_stop_signal)
    # Written by the C-level handler as the signal arrives, even while the
    # main thread waits in C++ and runs no Python handler.
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    return read_end


def _note_stop_signal(signum: int, frame: object) -> None:
    """The Python-level handler, run by the main thread when it next runs
    Python; the watcher thread, woken through the wakeup pipe, usually got
    there first (and then this returns at once)."""
    stop(signum)


def _watch(wakeup: int | None) -> None:
    while True:
        received = b""
        try:
            if wakeup is None:
                time.sleep(_PARENT_CHECK_SECONDS)
            else:
                ready, _, _ = select.select([wakeup], [], [], _PARENT_CHECK_SECONDS)
                received = os.read(wakeup, 64) if ready else b""
        except OSError:  # the pipe cannot break; keep watching the parent
            time.sleep(_PARENT_CHECK_SECONDS)
        for signum in received:
            if signum in STOP_SIGNALS:
                stop(signum)
        if _launcher_is_gone():
            _stop_now(signal.SIGTERM)


def _launcher_is_gone() -> bool:
    parent = _installed.get("parent")
    if parent is None:
        return False
    # The parent-death signal comes when the launcher's thread that started
    # this rank ends; until its other threads end too, the rank's parent is
    # still the launcher's pid, but its main thread is a zombie.
    return os.getppid() != parent or not _is_running(parent)


def _clean_up() -> None:
    """Run the `call_at_end` functions, then remove this rank's temporary
    files: its own temporary directory (under the launcher, its `TMPDIR` in
    the job directory, or the whole job directory once the launcher is gone)
    and unfinished saves."""
    for function in reversed(_at_end):
        with contextlib.suppress(Exception):
            function()
    paths = list(_temporaries)
    own = _installed.get("own_temporary_directory")
    if own is not None:
        paths.append(own)
    job_directory = _installed.get("job_directory")
    if job_directory is not None:
        if _launcher_is_gone():
            # Nobody else will remove the job directory.
            paths.append(job_directory)
        else:
            rank = _installed["rank"]
            paths.append(job_paths(job_directory, rank).temporary_directory)
    for path in paths:
        _remove(path)


def _remove_unfinished_saves() -> None:
    """Remove the files of unfinished saves once more, the moment before the
    process ends: the main thread goes on while another thread ends the
    process, and a save that had registered its temporary name but not yet
    created the file (`removed_if_stopped`) may create it after `_clean_up`
    looked (seen once in a loaded test run: SIGTERM to the launcher)."""
    for path in list(_temporaries):
        _remove(path)


def _remove(path: str) -> None:
    """Remove the file or directory `path`, if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        _remove_directory(path)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _remove_directory(path: str) -> None:
    """Remove `path` even while other threads (the heartbeat, the main thread
    until the process ends) still write into it: renamed first, their writes
    fail instead of leaving a directory that is not empty."""
    removed = f"{path}.removed-{os.getpid()}"
    try:
        os.rename(path, removed)
    except OSError:
        removed = path
    shutil.rmtree(removed, ignore_errors=True)


def _flush_output() -> None:
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A launcher that died leaves a broken pipe behind.
        with contextlib.suppress(Exception):
            stream.flush()


def _set_signal_action(signum: int, action: int) -> bool:
    """`signal(signum, action)` of the C library (SIG_DFL or SIG_IGN): unlike
    `signal.signal`, it works in any thread, and the main thread may be stuck
    in C++. False where the C library cannot be called."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(signum), int(action))
    except (OSError, AttributeError):
        return False
    return True


def _stop_process_group() -> None:
    """SIGTERM the processes this rank started, when it leads its process
    group (as under `keras-dist launch` and torchrun)."""
    if os.getpgid(0) != os.getpid():
        return
    if _set_signal_action(signal.SIGTERM, signal.SIG_IGN):  # not this process
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGTERM)


def _end_by_signal(signum: int) -> None:
    """End the process with `signum` (the processes it started, when it leads
    its process group, with SIGTERM first); exit code 128 + `signum` where the
    signal cannot be reset."""
    try:
        # Processes this rank started go too (the launcher starts each rank as
        # the leader of its own process group). SIGTERM, not `signum`: a
        # Python child takes SIGINT for a KeyboardInterrupt, which it may
        # catch, or lose while it still imports, and then it would stay.
        _stop_process_group()
        _remove_unfinished_saves()
        if not _set_signal_action(signum, signal.SIG_DFL):
            return  # the exit code says it instead
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the signal is delivered before this ends
    finally:
        os._exit(128 + int(signum))
