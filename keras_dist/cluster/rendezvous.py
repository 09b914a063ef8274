"""Exchanging every process' address through the coordinator, stdlib only.

TensorFlow's multi-worker runtime needs each worker's own `host:port`
(`TF_CONFIG`), while a launcher or `kd.initialize()` only knows the
coordinator's. Process 0 listens at the coordinator address; every other
process connects, says its rank and address and receives the full list. Every
wait is bounded and the errors name the rank.
"""

from __future__ import annotations

import json
import socket
import time

from keras_dist.cluster.addresses import find_free_port, join_address, split_address
from keras_dist.cluster.json_lines import LineReader, send


def _serve(
    coordinator_address: str, num_processes: int, own: str, timeout_seconds: float
) -> list[str]:
    _, port = split_address(coordinator_address)
    deadline = time.monotonic() + timeout_seconds
    addresses: dict[int, str] = {0: own}
    waiting: list[tuple[int, socket.socket]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", port))
        server.listen(num_processes * 2)
        try:
            while len(addresses) < num_processes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(num_processes)) - set(addresses))
                    raise RuntimeError(
                        f"Process 0 waited {timeout_seconds:g} s at "
                        f"{coordinator_address} for processes {missing} to join "
                        "the job; they never connected. Check that they are "
                        "running and point at this address."
                    )
                server.settimeout(remaining)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                try:
                    line = LineReader(conn).next_line(
                        min(deadline, time.monotonic() + 10)
                    )
                except OSError:
                    line = None
                if not line or not line.strip():  # a reachability probe
                    conn.close()
                    continue
                message = json.loads(line)
                addresses[int(message["rank"])] = str(message["address"])
                waiting.append((int(message["rank"]), conn))
            everyone = [addresses[rank] for rank in range(num_processes)]
            for _, conn in waiting:
                send(conn, everyone)
        finally:
            for _, conn in waiting:
                conn.close()
    return everyone


def _join(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    port: int,
    timeout_seconds: float,
) -> list[str]:
    host, coordinator_port = split_address(coordinator_address)
    deadline = time.monotonic() + timeout_seconds
    delay = 0.05
    last_error: OSError | None = None
    while True:
        try:
            with socket.create_connection(
                (host, coordinator_port),
                timeout=max(deadline - time.monotonic(), 0.1),
            ) as conn:
                own_host = conn.getsockname()[0]
                own = join_address(own_host, port)
                message = {"rank": process_id, "address": own}
                send(conn, message)
                line = LineReader(conn).next_line(deadline)
                if line and line.strip():
                    return [str(a) for a in json.loads(line)]
        except OSError as error:  # not listening yet: try again
            last_error = error
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"Process {process_id} of {num_processes} could not exchange "
                f"addresses with the coordinator at {coordinator_address} within "
                f"{timeout_seconds:g} s ({last_error}). Check that process 0 is "
                "running."
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def exchange_addresses(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout_seconds: float,
) -> list[str]:
    """Every process' `host:port`, in rank order, the same list everywhere.

    Each process gets a free port of its own; process 0 uses the coordinator's
    host. The coordinator port itself is only used for the exchange.

    Raises:
        RuntimeError: naming the rank (or the missing ranks, on process 0)
            when the exchange did not finish within `timeout_seconds`.
    """
    if process_id == 0:
        host, _ = split_address(coordinator_address)
        own = join_address(host, find_free_port(""))
        return _serve(coordinator_address, num_processes, own, timeout_seconds)
    return _join(
        coordinator_address,
        num_processes,
        process_id,
        find_free_port(""),
        timeout_seconds,
    )
