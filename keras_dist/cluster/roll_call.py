"""Every process checks in at the coordinator before the backend joins the job.

The backends' own handshakes fail badly when one side of a job never comes:
JAX aborts the process with a C++ `DEADLINE_EXCEEDED` dump, TensorFlow with a
`TF_CONFIG` waits forever and ignores signals, PyTorch names no rank; and a
coordinator port that is already taken gives JAX "Failed to start RPC server"
(sometimes a segfault) and TensorFlow a bare `OSError`. So before the backend
starts, process 0 listens at the coordinator's port itself (stdlib TCP, bounded
by the initialize timeout) and every other process connects and says its rank.
When everyone is there, process 0 closes the port and lets them go, and the
backend starts on the same port. Otherwise every process that can fails with a
Python error naming the missing ranks, the address and what to do.

The normal path costs one round trip per process. The processes close their
connections before process 0 closes its ends, so the coordinator's port is
not left in TIME_WAIT for the backend that binds it next.

Protocol, one JSON object per line: a process sends
`{"rank": r, "num_processes": n}`; process 0 answers `{"seconds_left": s}`
at once (how long it will still wait), then `{"go": true}` when everyone is
there, or `{"error": "..."}` when it gives up.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import time
from collections.abc import Callable

from keras_dist.cluster.addresses import split_address
from keras_dist.cluster.environments import TFConfigEnvironment, detect_cluster
from keras_dist.cluster.json_lines import LineReader, send

TIMEOUT_HINT = "`timeout_seconds=` or KERAS_DIST_INIT_TIMEOUT"
# How long process 0 waits for the processes it let go to close first, and how
# much longer than process 0's own deadline the others wait for its verdict.
_CLOSE_WAIT_SECONDS = 2.0
_VERDICT_GRACE_SECONDS = 5.0


def listen_at_coordinator(coordinator_address: str, backlog: int) -> socket.socket:
    """A socket listening on the coordinator's port on every interface (IPv4
    and IPv6 where the host has both, as JAX's coordinator does).

    Raises:
        RuntimeError: naming the address and the fix when the port is taken
            or cannot be used.
    """
    _, port = split_address(coordinator_address)
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port),
                family=socket.AF_INET6,
                backlog=backlog,
                dualstack_ipv6=True,
            )
        return socket.create_server(("", port), backlog=backlog)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise RuntimeError(
                f"Process 0 cannot start the job's coordinator at "
                f"{coordinator_address}: port {port} is already in use on this "
                "host (another job, or an earlier run that is still alive, "
                "listens there). Stop that program, or give the job a free port "
                "where its address is set (`job_addresses`, "
                "KERAS_DISTRIBUTION_JOB_ADDRESSES, MASTER_PORT, "
                "KERAS_DIST_COORDINATOR_PORT under SLURM, or TF_CONFIG); "
                "`keras-dist launch` without --coordinator picks a free one."
            ) from error
        raise RuntimeError(
            f"Process 0 cannot listen at the job's coordinator address "
            f"{coordinator_address} ({error}). Use a port this user may open "
            "(1024 or above) on a host that is this machine."
        ) from error


def _send(conn: socket.socket, message: dict) -> None:
    try:
        send(conn, message)
    except OSError:  # that process is gone; its absence is reported instead
        return


def _process_list(ranks: list[int], describe: Callable[[int], str]) -> str:
    names = [describe(rank) for rank in ranks]
    return f"process{'es' if len(names) > 1 else ''} {', '.join(names)}"


class _Coordinator:
    """Process 0's side: accept check-ins until everyone is there or the
    deadline passes."""

    def __init__(
        self,
        coordinator_address: str,
        num_processes: int,
        timeout_seconds: float,
        describe: Callable[[int], str],
    ) -> None:
        self.address = coordinator_address
        self.count = num_processes
        self.timeout = timeout_seconds
        self.describe = describe
        self.deadline = time.monotonic() + timeout_seconds
        self.buffers: dict[socket.socket, bytes] = {}
        self.ranks: dict[socket.socket, int] = {}
        self.problem: str | None = None

    def run(self) -> None:
        server = listen_at_coordinator(self.address, backlog=self.count * 2)
        selector = selectors.DefaultSelector()
        try:
            selector.register(server, selectors.EVENT_READ)
            while len(self.ranks) < self.count - 1 and self.problem is None:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in selector.select(timeout=min(remaining, 1.0)):
                    if key.fileobj is server:
                        self._accept(server, selector)
                    else:
                        self._read(key.fileobj, selector)
            # Nobody new may reach this port until the backend listens on it.
            selector.unregister(server)
            server.close()
            if self.problem is None and len(self.ranks) == self.count - 1:
                self._let_go(selector)
                return
            message = self.problem or self._missing_message()
            for conn in self.ranks:
                _send(conn, {"error": message})
            raise RuntimeError(message)
        finally:
            for conn in list(self.buffers):
                conn.close()
            server.close()
            selector.close()

    def _accept(self, server: socket.socket, selector: selectors.BaseSelector) -> None:
        try:
            conn, _ = server.accept()
        except OSError:  # the peer gave up between select and accept
            return
        conn.settimeout(_CLOSE_WAIT_SECONDS)
        self.buffers[conn] = b""
        selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket, selector: selectors.BaseSelector) -> None:
        try:
            chunk = conn.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:  # a reachability probe, or a process that went away
            selector.unregister(conn)
            self.buffers.pop(conn)
            self.ranks.pop(conn, None)
            conn.close()
            return
        self.buffers[conn] += chunk
        if conn in self.ranks or b"\n" not in self.buffers[conn]:
            return
        line = self.buffers[conn].split(b"\n", 1)[0]
        try:
            message = json.loads(line)
            rank, count = int(message["rank"]), int(message["num_processes"])
        except (ValueError, TypeError, KeyError):
            try:
                peer = conn.getpeername()[0]
            except OSError:  # it already left
                peer = "an address that already left"
            self.problem = (
                f"Something at {peer} connected to the job's coordinator at "
                f"{self.address} and sent {line[:80]!r}, not a keras_dist "
                "check-in. Give this job a port no other program uses."
            )
            return
        if count != self.count or not 0 < rank < count:
            self.problem = (
                f"A process checked in at the coordinator {self.address} as "
                f"process {rank} of {count}, but process 0 runs a job of "
                f"{self.count} processes. Give every process the same process "
                "count, each its own rank from 1 to "
                f"{self.count - 1} besides process 0."
            )
        elif rank in self.ranks.values():
            self.problem = (
                f"Two processes checked in at the coordinator {self.address} as "
                f"process {rank} of {count}. Give each process its own rank "
                "(`process_id`, KERAS_DISTRIBUTION_PROCESS_ID, RANK or "
                "SLURM_PROCID), or give a second job its own port."
            )
        self.ranks[conn] = rank
        _send(conn, {"seconds_left": max(self.deadline - time.monotonic(), 0.0)})

    def _missing_message(self) -> str:
        missing = sorted(set(range(1, self.count)) - set(self.ranks.values()))
        return (
            f"Process 0 waited {self.timeout:g} s at the job's coordinator "
            f"{self.address} for {_process_list(missing, self.describe)}, which "
            f"never checked in ({len(self.ranks) + 1} of the job's {self.count} "
            "processes did). Start every process of the job with "
            f"this coordinator address (reachable from every host), or give "
            f"them longer with {TIMEOUT_HINT}."
        )

    def _let_go(self, selector: selectors.BaseSelector) -> None:
        for conn in self.ranks:
            _send(conn, {"go": True})
        # Wait for the others to close first: then TIME_WAIT stays on their
        # side and the backend can bind this port at once.
        until = time.monotonic() + _CLOSE_WAIT_SECONDS
        while self.buffers and time.monotonic() < until:
            for key, _ in selector.select(timeout=until - time.monotonic()):
                conn = key.fileobj
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    chunk = b""
                if not chunk:
                    selector.unregister(conn)
                    self.buffers.pop(conn)
                    conn.close()


def _check_in(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    timeout_seconds: float,
) -> None:
    host, port = split_address(coordinator_address)
    who = f"Process {process_id} of {num_processes}"
    deadline = time.monotonic() + timeout_seconds
    delay = 0.05
    last_error: OSError | None = None
    while True:
        try:
            conn = socket.create_connection(
                (host, port), timeout=min(max(deadline - time.monotonic(), 0.1), 10.0)
            )
        except OSError as error:  # process 0 is not listening yet
            last_error = error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"{who} could not reach the job's coordinator at "
                    f"{coordinator_address} within {timeout_seconds:g} s "
                    f"({last_error}): process 0 never listened there. Start "
                    "process 0, check that this address is process 0's host and "
                    f"port and that it is reachable from here, or give it longer "
                    f"with {TIMEOUT_HINT}."
                ) from None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)
            continue
        with conn:
            try:
                send(conn, {"rank": process_id, "num_processes": num_processes})
            except OSError:
                ack = None
            else:
                reader = LineReader(conn)
                # Process 0 answers at once; something else may never answer.
                ack = reader.next(max(deadline, time.monotonic() + 1.0))
            if ack is None:
                if time.monotonic() < deadline:
                    time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                    continue  # process 0 closed its port just now: ask again
                raise RuntimeError(
                    f"{who} connected to {coordinator_address}, but no keras_dist "
                    "coordinator answered there. Check that this is process 0's "
                    "address and that no other program uses the port."
                )
            if "error" in ack:
                raise RuntimeError(f"{who} stops, process 0 gave up: {ack['error']}")
            waited = time.monotonic()
            seconds_left = float(ack.get("seconds_left", 0.0))
            verdict = reader.next(waited + seconds_left + _VERDICT_GRACE_SECONDS)
        if verdict is not None and verdict.get("go"):
            return
        if verdict is not None and "error" in verdict:
            raise RuntimeError(f"{who} stops, process 0 gave up: {verdict['error']}")
        raise RuntimeError(
            f"{who} checked in at the job's coordinator {coordinator_address}, "
            "but process 0 went away before every process had joined; its own "
            "error says why."
        )


def roll_call(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout_seconds: float,
    describe: Callable[[int], str] = str,
) -> None:
    """Return once every process of the job has checked in at the coordinator.

    Process 0 listens on the coordinator's port until the others have
    connected; each other process connects (retrying until process 0
    listens) and waits for process 0 to let it go. Afterwards the port is free
    again for the backend's own coordinator.

    Args:
        coordinator_address: process 0's `"host:port"`.
        num_processes: processes in the job.
        process_id: this process' rank.
        timeout_seconds: how long process 0 waits for the others, and the
            others for process 0 to listen.
        describe: how errors name a rank (e.g. with its `TF_CONFIG` address).

    Raises:
        RuntimeError: naming the ranks that never checked in (or, on the
            others, the unreachable coordinator), the address and the fix; or
            naming the address when its port is already in use.

    Example:

    >>> roll_call("127.0.0.1:29500", 2, 1, timeout_seconds=60)  # doctest: +SKIP
    """
    if process_id == 0:
        coordinator = _Coordinator(
            coordinator_address, num_processes, timeout_seconds, describe
        )
        coordinator.run()
    else:
        _check_in(coordinator_address, num_processes, process_id, timeout_seconds)


def _describe_from_tf_config(coordinator_address: str, num_processes: int):
    """How errors name a rank: with its task and address when the job is the
    `TF_CONFIG` cluster, else by its number."""
    cluster = detect_cluster()
    if not isinstance(cluster, TFConfigEnvironment):
        return str
    try:
        tasks = cluster.tasks()
    except ValueError:  # resolve_cluster reports a malformed TF_CONFIG
        return str
    if len(tasks) != num_processes or tasks[0][2] != coordinator_address:
        return str  # the job came from elsewhere; TF_CONFIG is stale

    def describe(rank: int) -> str:
        task_type, index, address = tasks[rank]
        return f"{rank} (TF_CONFIG {task_type} {index} at {address})"

    return describe


def check_in_everyone(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout_seconds: float,
) -> None:
    """`roll_call` for `keras_dist.initialize`, naming `TF_CONFIG` tasks.

    Skipped in processes started by torchrun's agent when it keeps the
    job's store (`TORCHELASTIC_USE_AGENT_STORE=True`): the agent then holds
    the coordinator's port, and its own rendezvous already formed the job.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    roll_call(
        coordinator_address,
        num_processes,
        process_id,
        timeout_seconds=timeout_seconds,
        describe=_describe_from_tf_config(coordinator_address, num_processes),
    )
