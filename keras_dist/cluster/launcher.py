"""`keras-dist launch`: start one process per rank, watch them, end them together.

This module uses only the standard library: it must not import keras or a
backend, because the processes it starts pick their own backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TextIO

from keras_dist.cluster import elastic_nodes, hang_doctor
from keras_dist.cluster.addresses import (
    LOCAL_COORDINATOR_HOST,
    find_free_port,
    split_address,
)
from keras_dist.cluster.job_dir import (
    HANG_TIMEOUT_VARIABLE,
    JOB_DIRECTORY_PREFIX,
    JOB_DIRECTORY_VARIABLE,
    LAUNCHER_PID_VARIABLE,
    PREEMPTED_EXIT_CODE,
    describe_error_report,
    describe_exception,
    job_paths,
    read_error_reports,
    remove_stale_job_directories,
    reported_own_failure,
    write_rank_pid,
)
from keras_dist.cluster.launch_config import (
    DEFAULT_GRACE_PERIOD_SECONDS,
    LaunchConfig,
)
from keras_dist.cluster.rank_output import RankOutput

__all__ = ["DEFAULT_GRACE_PERIOD_SECONDS", "LaunchConfig", "Launcher", "launch"]

# After the first failure, how long the other ranks get to end (and report)
# on their own before they are stopped: the root cause may not be the first
# exit the launcher sees (see `Launcher._root_cause`).
_REPORT_WAIT_SECONDS = 1.0
# Signals that end a rank from outside; a failing peer causes exceptions and
# aborts (SIGABRT), never these (the launcher stops ranks only after it has
# named the root cause).
_SIGNALS_FROM_OUTSIDE = frozenset(
    {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
)
# Polling keeps the watch loop simple; 50 ms is far below any time that matters.
_POLL_SECONDS = 0.05
# Readers block while a grandchild keeps a pipe open; wait on them only briefly.
_SHORT_WAIT_SECONDS = 2.0


def rank_environment(
    config: LaunchConfig,
    local_rank: int,
    coordinator: str,
    *,
    restart_count: int = 0,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one process: what `keras_dist.initialize()` and torch
    read to join the job.

    Args:
        config: the launch.
        local_rank: the process' index on this node.
        coordinator: `"host:port"` every process connects to.
        restart_count: how many times the group was restarted before.
        base: the environment to extend; defaults to this process'.

    Returns:
        A new dict; `base` is left unchanged.

    Example:

    >>> env = rank_environment(config, 1, "127.0.0.1:29500")
    >>> env["KERAS_DISTRIBUTION_PROCESS_ID"]
    '1'
    """
    host, port = split_address(coordinator, name="coordinator")
    rank = config.node_rank * config.nproc_per_node + local_rank
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": coordinator,
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(config.world_size),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
            "KERAS_DIST_LOCAL_RANK": str(local_rank),
            "KERAS_DIST_RESTART_COUNT": str(restart_count),
            # The names torchrun sets, so torch code and cluster detection work.
            "RANK": str(rank),
            "WORLD_SIZE": str(config.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(config.node_rank),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
    )
    if config.hang_timeout is not None:
        env[HANG_TIMEOUT_VARIABLE] = repr(float(config.hang_timeout))
    # Output is forwarded line by line; a block-buffered child would show its
    # lines late, or never when it is killed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def describe_exit(rank: int, returncode: int) -> str:
    """`"rank 1 exited with code 3"` or `"rank 1 was killed by signal SIGKILL"`."""
    if returncode == PREEMPTED_EXIT_CODE:
        return (
            f"rank {rank} was preempted (SIGTERM or SIGUSR1) and exited with code "
            f"{returncode} after its kd.Checkpoint saved the job's state"
        )
    if returncode >= 0:
        return f"rank {rank} exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"number {-returncode}"
    return f"rank {rank} was killed by signal {name}"


def _exit_code(returncode: int) -> int:
    # A signal becomes 128 + its number, as a shell reports it.
    return returncode if returncode >= 0 else 128 - returncode


_PR_SET_PDEATHSIG = 1
_PRCTL = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        # Looked up now: after fork, in the child, only the call is safe.
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def set_parent_death_signal(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent dies
    (Linux; elsewhere nothing: ranks also check their parent themselves).

    Runs in the child between fork and exec (`Popen(preexec_fn=...)`), so it
    calls only the C library."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


@dataclasses.dataclass
class _RankProcess:
    rank: int
    process: subprocess.Popen
    readers: list[threading.Thread]
    # Wall-clock time of its exit, set by its waiter thread as it happens (it
    # orders the failures, see `Launcher._root_cause`).
    exited_at: float | None = None


class Launcher:
    """Runs a `LaunchConfig` and returns the job's exit code.

    Every process runs in its own process group, so stopping a rank stops
    what it started too; when an attempt ends, whatever is left in those
    groups is killed, so nothing outlives the job. Output lines are prefixed
    with `[rank N] `. Ranks get a parent-death signal (Linux), so they end
    with the launcher even when it is SIGKILLed. When a rank fails, one line
    names the root cause: the first rank to fail, with its uncaught exception
    (type and message, from its error report) or its exit code or signal,
    e.g. `keras-dist: rank 1 failed: ValueError: ...; stopped the other 1
    process(es)`. It is the last line: what the other ranks print from the
    failure on (a torch rank that lost its peer prints gloo's errors, which
    blame the user's code) is held and written before it, under a line that
    labels it a consequence, and the summary says which ranks failed after the
    root cause (`keras_dist.cluster.rank_output`). A rank that says it failed
    on its own (its exception raised in the program's own code, or before any
    other rank had ended: `keras_dist.faults.own_failure`) is no consequence:
    the summary names it and its exception too, and its output is not
    labelled.

    Args:
        config: what to start.
        stdout: where the processes' stdout lines go; defaults to `sys.stdout`.
        stderr: where their stderr lines and the launcher's messages go;
            defaults to `sys.stderr`.

    Example:

    >>> exit_code = Launcher(LaunchConfig("train.py", nproc_per_node=2)).run()
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.config = config
        self._stdout = stdout if stdout is not None else sys.stdout
        self._stderr = stderr if stderr is not None else sys.stderr
        self._output: RankOutput | None = None
        # While the launcher stops ranks itself, their exits are no failures.
        self._stopping = False
        self._stop_signals: list[int] = []
        self._wake = threading.Event()
        # SIGUSR1 (`sbatch --signal`, forwarded by srun) is passed on to the
        # ranks, which save and exit 75 themselves; no restart after it.
        self._preemption_signals: list[int] = []
        self._ranks: list[_RankProcess] = []
        # The group an attempt starts: the config, with fewer processes after
        # an elastic job lost some.
        self._attempt_config = config
        # The root cause's rank of the last failed attempt (None: a hang or a
        # signal to the launcher).
        self._lost_rank: int | None = None
        # An elastic multi-node job's reason to stop this node's processes
        # now (the membership changes), checked while they run.
        self._external_stop: Callable[[], str | None] | None = None

    def run(self) -> int:
        """Start the group, restart it after failures, and wait for the end.

        Returns:
            0 when every process succeeded; the failed rank's exit code (128 +
            the signal number when a signal killed it) after the last attempt;
            130 or 143 when SIGINT or SIGTERM stopped the launcher.
        """
        previous_handlers = self._install_signal_handlers()
        self._output = RankOutput(self._stdout, self._stderr)
        config = self.config
        try:
            if config.elastic_nodes:
                return elastic_nodes.run(self)
            restarts = 0
            for attempt in itertools.count():
                exit_code, failure = self._run_attempt(attempt)
                if failure is None or self._stop_signals or self._preemption_signals:
                    return exit_code
                size = self._attempt_config.nproc_per_node
                if restarts < config.max_restarts:
                    restarts += 1
                    self._message(
                        f"restart {restarts} of {config.max_restarts}: "
                        f"starting all {size} process(es) again"
                    )
                    continue
                if not config.elastic or self._lost_rank is None:
                    return exit_code
                if size - 1 < config.min_nproc:
                    self._message(
                        f"elastic: rank {self._lost_rank} lost with no restart "
                        f"left, and {size - 1} process(es) would be fewer than "
                        f"--min-nproc {config.min_nproc}: the job ends"
                    )
                    return exit_code
                self._attempt_config = dataclasses.replace(
                    self._attempt_config, nproc_per_node=size - 1
                )
                self._message(
                    f"elastic: rank {self._lost_rank} lost ({failure}) with no "
                    f"restart left: going on with {size - 1} process(es) of "
                    f"{config.nproc_per_node} (at least {config.min_nproc}); "
                    "training resumes from its last checkpoint"
                )
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            self._output.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)

    def _install_signal_handlers(self) -> dict[int, object]:
        # Python only lets the main thread install handlers; a launcher run in
        # another thread relies on its caller to stop it.
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._on_signal)
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_preemption)
        return previous

    def _on_preemption(self, signum: int, frame: object) -> None:
        """SIGUSR1: pass it on to every rank's process group and keep
        watching; a rank with a `kd.Checkpoint` saves at the step all agree on
        and exits 75, and the launcher then exits 75 too (without restarting),
        which tells a batch script to requeue. Under SLURM every process of
        the step may get the signal itself as well; a second one changes
        nothing."""
        self._preemption_signals.append(signum)
        for rank in self._ranks:
            if rank.process.poll() is None:
                _signal_group(rank.process.pid, signum)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signals.append(signum)
        self._wake.set()

    def _coordinator(self) -> str:
        if self._attempt_config.coordinator is not None:
            # Fixed, or an elastic multi-node round's (from its rendezvous).
            return self._attempt_config.coordinator
        # A new port per attempt: the old one may linger in TIME_WAIT.
        return f"{LOCAL_COORDINATOR_HOST}:{find_free_port(LOCAL_COORDINATOR_HOST)}"

    def _run_attempt(self, attempt: int) -> tuple[int | None, str | None]:
        """One run of the whole group; returns `(exit_code, failure message)`."""
        coordinator = self._coordinator()
        ranks: list[_RankProcess] = []
        # One directory per attempt: error reports, heartbeats and every
        # rank's TMPDIR; removed when the attempt ends, however it ends.
        remove_stale_job_directories()
        self._job_directory = tempfile.mkdtemp(
            prefix=f"{JOB_DIRECTORY_PREFIX}{os.getpid()}_"
        )
        self._ranks = ranks
        self._stopping = False
        self._lost_rank = None
        try:
            for local_rank in range(self._attempt_config.nproc_per_node):
                if self._stop_signals:
                    break
                ranks.append(self._start(local_rank, coordinator, attempt))
            return self._watch(ranks)
        finally:
            # Also reached on success and on an unexpected error: nothing the
            # ranks started may outlive the attempt.
            self._stop(ranks)
            # Nothing a rank printed is lost, whatever ended the attempt.
            self._output.release()
            shutil.rmtree(self._job_directory, ignore_errors=True)

    def _start(self, local_rank: int, coordinator: str, attempt: int) -> _RankProcess:
        config = self._attempt_config
        env = rank_environment(config, local_rank, coordinator, restart_count=attempt)
        rank = int(env["RANK"])
        paths = job_paths(self._job_directory, rank)
        os.makedirs(paths.temporary_directory, exist_ok=True)
        env[JOB_DIRECTORY_VARIABLE] = self._job_directory
        # Python's `tempfile` (and so Keras and keras_dist) writes there.
        env["TMPDIR"] = paths.temporary_directory
        env[LAUNCHER_PID_VARIABLE] = str(os.getpid())
        process = subprocess.Popen(
            [sys.executable, config.script, *config.script_args],
            env=env,
            # N processes cannot share one terminal's input.
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Own session and process group: a terminal's Ctrl-C reaches only
            # the launcher, and killing the group reaches grandchildren.
            start_new_session=True,
            # Ranks end with the launcher, even when it is SIGKILLed.
            preexec_fn=set_parent_death_signal if _PRCTL is not None else None,
        )
        # The other ranks check whether it still runs when they fail.
        write_rank_pid(self._job_directory, rank, process.pid)
        readers = [
            threading.Thread(
                target=self._output.forward,
                args=(pipe, rank, name),
                name=f"keras-dist-rank-{rank}-{name}",
                daemon=True,
            )
            for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))
        ]
        for reader in readers:
            reader.start()
        rank_process = _RankProcess(rank, process, readers)
        threading.Thread(
            target=self._wait_for_exit,
            args=(rank_process,),
            name=f"keras-dist-rank-{rank}-exit",
            daemon=True,
        ).start()
        return rank_process

    def _wait_for_exit(self, rank: _RankProcess) -> None:
        rank.process.wait()
        ended = time.monotonic()
        rank.exited_at = time.time()
        if rank.process.returncode not in (0, PREEMPTED_EXIT_CODE) and not (
            self._stopping
        ):
            # What the others print from now on is held until the root cause
            # is named (`RankOutput`).
            self._output.hold_from(ended)
        self._wake.set()

    def _watch(self, ranks: list[_RankProcess]) -> tuple[int | None, str | None]:
        """Wait until all succeed, one fails, one hangs, or the launcher is
        signalled; `(None, reason)` when `_external_stop` stopped them."""
        self._hang_doctor = None
        while True:
            if self._stop_signals:
                name = signal.Signals(self._stop_signals[0]).name
                running = self._stop(ranks)
                self._message(f"received {name}; stopped {running} process(es)")
                return 128 + self._stop_signals[0], f"received {name}"
            reason = self._external_stop() if self._external_stop else None
            if reason is not None:
                # SIGTERM: a kd.Checkpoint saves at the step all agree on.
                stopped = self._stop(ranks)
                self._message(f"elastic: {reason}; stopped {stopped} process(es)")
                return None, reason
            running = [r for r in ranks if r.exited_at is None]
            failed = [r for r in ranks if r.exited_at and r.process.returncode != 0]
            if failed:
                self._wait_for_others(ranks)
                reports = read_error_reports(
                    self._job_directory, [r.rank for r in ranks]
                )
                root, exit_code, failure = self._root_cause(ranks, reports)
                self._lost_rank = root
                # Failures in their own right besides the root cause, as the
                # ranks tell (`keras_dist.faults.own_failure`).
                own = {
                    rank: describe_exception(report)
                    for rank, report in reports.items()
                    if rank != root and reported_own_failure(report)
                }
                # The ranks that failed after the root cause, its consequence.
                after = [
                    r.rank
                    for r in ranks
                    if r.rank != root
                    and r.rank not in own
                    and r.exited_at
                    and r.process.returncode not in (0, PREEMPTED_EXIT_CODE)
                ]
                stopped = self._stop(ranks)
                # The others' output since the failure, labelled, then the
                # summary: the root cause is the last thing a user reads.
                self._message(
                    self._output.release_after_failure(
                        root, failure, after, stopped, own=own
                    )
                )
                return exit_code, failure
            hang = self._check_hang(ranks)
            if hang is not None:
                stopped = self._stop(ranks)
                exit_code = self._hang_doctor.exit_code
                self._message(f"{hang}\nkeras-dist: stopped {stopped} process(es)")
                return exit_code, hang.splitlines()[0]
            if not running:
                self._join_readers(ranks)
                return 0, None
            self._wake.wait(_POLL_SECONDS)
            self._wake.clear()  # the loop looks at everything that set it

    def _check_hang(self, ranks: list[_RankProcess]) -> str | None:
        """The hang doctor's summary once a rank stopped advancing, else None
        (`keras_dist.faults.hang_doctor`)."""
        if self._hang_doctor is None:
            by_rank = {r.rank: r for r in ranks}
            self._hang_doctor = hang_doctor.HangDoctor(
                self._job_directory,
                {
                    r.rank: job_paths(self._job_directory, r.rank).heartbeat_file
                    for r in ranks
                },
                lambda rank: by_rank[rank].exited_at is None,
                world_size=self._attempt_config.world_size,
            )
        return self._hang_doctor.check()

    def _wait_for_others(self, ranks: list[_RankProcess]) -> None:
        """Give the other ranks a moment to report or end on their own: a rank
        that failed first may exit after a rank its failure brought down."""
        deadline = time.monotonic() + _REPORT_WAIT_SECONDS
        while (
            time.monotonic() < deadline
            and not self._stop_signals
            and any(r.exited_at is None for r in ranks)
        ):
            self._wake.wait(_POLL_SECONDS)
            self._wake.clear()

    def _root_cause(
        self, ranks: list[_RankProcess], reports: dict[int, dict]
    ) -> tuple[int, int, str]:
        """`(rank, exit code, message)` of the first rank that failed, named by its
        error report (its uncaught exception) when it wrote one, else by its
        exit code or signal.

        A rank killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP: never
        what another rank's failure causes) comes first. Otherwise ranks are
        ordered by when they ended, not by when they reported: a rank's
        failure reaches the others when its process ends (its sockets close),
        so a rank killed by a signal ends before the exceptions it causes
        elsewhere are reported, and a rank that raised (and reported) ends
        before the aborts it causes. A rank still running counts from its
        report.
        """
        causes = []
        for rank in ranks:
            returncode = rank.process.returncode if rank.exited_at else None
            report = reports.get(rank.rank)
            if report is not None:
                ended = rank.exited_at or report["timestamp"]
                code = _exit_code(returncode) if returncode else 1
                causes.append((ended, rank.rank, code, describe_error_report(report)))
            elif returncode:
                failure = describe_exit(rank.rank, returncode)
                if -returncode in _SIGNALS_FROM_OUTSIDE:
                    ended = -math.inf  # before anything it may have caused
                else:
                    ended = rank.exited_at
                causes.append((ended, rank.rank, _exit_code(returncode), failure))
        _, root, exit_code, failure = min(causes, key=lambda cause: cause[0])
        return root, exit_code, failure

    def _stop(self, ranks: list[_RankProcess]) -> int:
        """SIGTERM every process group, SIGKILL after the grace period.

        Returns:
            How many ranks were still running when asked to stop.
        """
        self._stopping = True
        running = [r for r in ranks if r.process.poll() is None]
        if running:
            for rank in running:
                _signal_group(rank.process.pid, signal.SIGTERM)
            signals_seen = len(self._stop_signals)
            deadline = time.monotonic() + self.config.grace_period_seconds
            while time.monotonic() < deadline and any(
                r.process.poll() is None for r in running
            ):
                # A second Ctrl-C means "now", as with most launchers.
                if len(self._stop_signals) > max(signals_seen, 1):
                    break
                time.sleep(_POLL_SECONDS)
        # Sweep every group, including those of ranks that already exited, so
        # grandchildren that ignored SIGTERM or outlived their parent go too.
        for rank in ranks:
            _signal_group(rank.process.pid, signal.SIGKILL)
        for rank in ranks:
            try:
                # SIGKILL cannot be ignored; only a process stuck in the kernel
                # outlives this wait, and then it is not worth hanging for.
                rank.process.wait(_SHORT_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                continue
        self._join_readers(ranks)
        return len(running)

    def _join_readers(self, ranks: list[_RankProcess]) -> None:
        deadline = time.monotonic() + _SHORT_WAIT_SECONDS
        for rank in ranks:
            for reader in rank.readers:
                reader.join(max(0.0, deadline - time.monotonic()))

    def _message(self, text: str) -> None:
        self._output.message(text)


def _signal_group(process_group: int, signum: int) -> None:
    try:
        os.killpg(process_group, signum)
    except (ProcessLookupError, PermissionError):
        # The group is already empty (or the id now belongs to someone else).
        return


def launch(
    script: str,
    script_args: tuple[str, ...] | list[str] = (),
    *,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    max_restarts: int = 0,
    grace_period_seconds: float = DEFAULT_GRACE_PERIOD_SECONDS,
    hang_timeout: float | None = None,
    min_nproc: int | None = None,
) -> int:
    """Run `script` as `nproc_per_node` processes of a (possibly multi-node) job.

    Each process gets `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
    `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`, so
    `keras_dist.initialize()` joins the job, plus torchrun's `RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
    `MASTER_ADDR` and `MASTER_PORT`. When one process fails, the others are
    stopped. On several nodes, every node runs the same call with its own
    `node_rank`; each node restarts its own processes.

    Args:
        script: path of the Python script.
        script_args: arguments for every copy of the script.
        nproc_per_node: processes on this node.
        nnodes: nodes in the job.
        node_rank: this node's index.
        coordinator: `"host:port"` of node 0; required when `nnodes > 1`.
        max_restarts: restarts of the whole group after a failure.
        grace_period_seconds: time between SIGTERM and SIGKILL when stopping.
        hang_timeout: seconds without progress before the hang doctor ends
            the job (see `LaunchConfig`); None: `KERAS_DIST_HANG_TIMEOUT` or
            1800; 0: off.
        min_nproc: elastic: the fewest processes the job may go on with once
            its restarts are used up (see `LaunchConfig`); None: no fewer
            than `nproc_per_node`.

    Returns:
        The exit code: 0 when all processes succeeded, else the failed rank's
        code (128 + signal number if a signal killed it), 124 when a rank
        hung, or 130/143 when the launcher got SIGINT/SIGTERM.

    Example:

    >>> exit_code = launch("train.py", ["--epochs", "3"], nproc_per_node=2)
    """
    config = LaunchConfig(
        script,
        tuple(script_args),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        coordinator=coordinator,
        max_restarts=max_restarts,
        grace_period_seconds=grace_period_seconds,
        hang_timeout=hang_timeout,
        min_nproc=min_nproc,
    )
    return Launcher(config).run()
