"""Devices, processes and joining a multi-process job."""

from __future__ import annotations

import math
import os
import socket
import time
import warnings

import numpy as np

from keras_dist._roll_call import check_in_everyone
from keras_dist.backends import get_adapter
from keras_dist.cluster import (
    detect_cluster,
    environment_int,
    environment_value,
    split_address,
)
from keras_dist.faults import heartbeat, lifecycle

_DEVICE_TYPES = ("cpu", "gpu", "tpu")
DEFAULT_INIT_TIMEOUT_SECONDS = 300.0
JOB_ADDRESSES_VARIABLE = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
NUM_PROCESSES_VARIABLE = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "KERAS_DISTRIBUTION_PROCESS_ID"
TIMEOUT_VARIABLE = "KERAS_DIST_INIT_TIMEOUT"

_initialized: dict[str, object] = {}


def _check_device_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise ValueError(
            f"`device_type` must be one of {list(_DEVICE_TYPES)} or None. "
            f"Received: device_type={device_type!r}"
        )
    return device_type.lower()


def list_devices(device_type: str | None = None) -> list[str]:
    """All devices of the job, as names like `"cpu:0"` or `"gpu:3"`.

    Args:
        device_type: `"cpu"`, `"gpu"` or `"tpu"`. Defaults to the accelerators
            when there are any, else the CPUs.

    Returns:
        The global device names, in the order a mesh uses them.

    Example:

    >>> keras_dist.list_devices("cpu")[0]
    'cpu:0'
    """
    return get_adapter().list_devices(_check_device_type(device_type))


def get_device_count(device_type: str | None = None) -> int:
    """How many devices `list_devices(device_type)` returns."""
    return len(list_devices(device_type))


def num_processes() -> int:
    """Processes in the job; 1 until `initialize` joined a larger one."""
    return get_adapter().num_processes()


def process_id() -> int:
    """This process' rank, from 0 to `num_processes() - 1`."""
    return get_adapter().process_id()


def _int_or_none(name: str, value: object) -> int | None:
    """An explicit argument: an int or None; anything else, a fraction or a
    string included, is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int. Received: {name}={value!r}")
    return int(value)


def resolve_cluster(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str | None, int, int]:
    """Work out `(coordinator_address, num_processes, process_id)`.

    Each value comes from the first of: the explicit argument; the
    `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES` and
    `KERAS_DISTRIBUTION_PROCESS_ID` variables (several job addresses also give
    the process count); the cluster this process was launched in (Ray Train,
    torchrun, SLURM, Kubeflow's JAX and torch runtimes, JobSet, `TF_CONFIG`:
    see `keras_dist.cluster`). The cluster is only
    read when something is still missing, and a value from the arguments or
    `KERAS_DISTRIBUTION_*` wins over the cluster's even when they disagree.
    Without any of them, the job is one process.

    Returns:
        The coordinator's `"host:port"` (None for a one-process job without
        one), the process count and this process' rank.

    Example:

    >>> keras_dist.runtime.resolve_cluster("10.0.0.1:1234", 4, 3)
    ('10.0.0.1:1234', 4, 3)
    """
    count = _int_or_none("num_processes", num_processes)
    count_source = "the `num_processes` argument"
    if count is None:
        count = environment_int(NUM_PROCESSES_VARIABLE)
        count_source = NUM_PROCESSES_VARIABLE
    rank = _int_or_none("process_id", process_id)
    rank_source = "the `process_id` argument"
    if rank is None:
        rank = environment_int(PROCESS_ID_VARIABLE)
        rank_source = PROCESS_ID_VARIABLE

    address_source = "the `job_addresses` argument"
    if job_addresses is None:
        job_addresses = environment_value(JOB_ADDRESSES_VARIABLE)
        address_source = JOB_ADDRESSES_VARIABLE
    addresses: list[str] = []
    if job_addresses is not None:
        if not isinstance(job_addresses, str):
            raise TypeError(
                "`job_addresses` must be a comma-separated string of 'host:port'. "
                f"Received: job_addresses={job_addresses!r}"
            )
        addresses = [a.strip() for a in job_addresses.split(",")]
        for address in addresses:
            split_address(address)
    if count is None and len(addresses) > 1:
        count, count_source = len(addresses), address_source

    if count is None or (count > 1 and (rank is None or not addresses)):
        cluster = detect_cluster()
        if cluster is not None:
            cluster_address = cluster.coordinator_address()
            cluster_count = cluster.num_processes()
            cluster_rank = cluster.process_id()
            if not addresses:
                addresses = [cluster_address]
            if count is None:
                count = cluster_count
                count_source = cluster.num_processes_source
            if rank is None:
                rank = cluster_rank
                rank_source = cluster.process_id_source

    if count is None:
        count = 1
    if count < 1:
        raise ValueError(
            f"`num_processes` must be at least 1. Received: num_processes={count}"
        )
    if len(addresses) > 1 and len(addresses) != count:
        raise ValueError(
            f"`job_addresses` lists {len(addresses)} jobs but `num_processes` is "
            f"{count}. Received: job_addresses={job_addresses!r}"
        )
    if rank is None:
        if count > 1:
            raise ValueError(
                f"A job of {count} processes needs this process' `process_id` "
                f"(or {PROCESS_ID_VARIABLE}, or a launcher such as torchrun or "
                "srun that sets RANK or SLURM_PROCID)."
            )
        rank = 0
    if not 0 <= rank < count:
        raise ValueError(
            f"`process_id` must be in [0, {count - 1}]. Received: "
            f"process_id={rank}, num_processes={count} (process_id from "
            f"{rank_source}, num_processes from {count_source})"
        )
    if count > 1 and not addresses:
        raise ValueError(
            f"A job of {count} processes needs the coordinator's 'host:port' in "
            f"`job_addresses` (or {JOB_ADDRESSES_VARIABLE})."
        )
    return (addresses[0] if addresses else None), count, rank


def _timeout_from_environment() -> float:
    raw = os.environ.get(TIMEOUT_VARIABLE, "")
    try:
        seconds = float(raw) if raw else DEFAULT_INIT_TIMEOUT_SECONDS
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):  # "nan", "inf", "-1"
        raise ValueError(
            f"{TIMEOUT_VARIABLE} must be a positive number of seconds. "
            f"Received: {TIMEOUT_VARIABLE}={raw!r}"
        )
    return seconds


def _wait_for_coordinator(
    coordinator_address: str,
    process_id: int,
    num_processes: int,
    *,
    timeout_seconds: float,
) -> None:
    """Block until something accepts TCP connections at `coordinator_address`.

    Process 0 starts the coordinator, often after the others because it is
    slower to import; this retries until `timeout_seconds` have passed. Without
    it, an unreachable coordinator ends a JAX process with an abort that names
    neither the rank nor the address.

    Raises:
        RuntimeError: naming the rank and the address when nothing answered.
    """
    host, port = split_address(coordinator_address)
    deadline = time.monotonic() + timeout_seconds
    delay = 0.05
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(
                (host, port), timeout=min(max(remaining, 0.1), 10.0)
            ):
                return
        except OSError as error:
            last_error = error
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 1.0)
    raise RuntimeError(
        f"Process {process_id} of {num_processes} could not reach the coordinator at "
        f"{coordinator_address} within {timeout_seconds:g} s ({last_error}). "
        "Check that process 0 is running and that the address is right; give it "
        f"longer with `timeout_seconds=` or {TIMEOUT_VARIABLE}."
    )


def initialize(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_seconds: float | None = None,
    hang_timeout: float | None = None,
) -> None:
    """Join a multi-process job; a no-op for a single process.

    Called without arguments inside a Ray Train worker, torchrun, an `srun`
    task, a Kubeflow or JobSet pod or a `TF_CONFIG` cluster, it finds the job
    on its own (`keras-dist env` shows what it detects); see
    `resolve_cluster` for the order in which arguments,
    `KERAS_DISTRIBUTION_*` variables and the cluster are asked. When none
    of them says anything, the backend's own detection runs last, as in
    Keras: on JAX `jax.distributed.initialize()` without arguments (Cloud
    TPU, GKE, Open MPI, `JAX_COORDINATOR_ADDRESS`); with no cluster detected
    the process runs alone.

    Args:
        job_addresses: `"host:port"` of the coordinator (process 0), or every
            process' address separated by commas (the first is the coordinator).
        num_processes: processes in the job.
        process_id: this process' rank, `0 <= process_id < num_processes`.
        timeout_seconds: how long to wait for the other processes before
            failing with an error naming the coordinator. Defaults to
            `KERAS_DIST_INIT_TIMEOUT` or 300. Every process first checks in
            at the coordinator (process 0 listens on its port): process 0
            waits up to this long for the others and then names the ranks
            that never came, the others wait up to this long for process 0;
            a port already in use is an error at once. Then the backend
            gets this long again to complete its own handshake (PyTorch
            also uses it as the timeout of its collectives).
        hang_timeout: seconds a process may go without progress inside a
            distributed `fit`/`evaluate`/`predict` (a step, a callback, a
            batch, a save) before every process dumps its Python stacks and
            the job ends naming the rank behind (`keras_dist.faults.heartbeat`).
            Defaults to `KERAS_DIST_HANG_TIMEOUT` (`keras-dist launch
            --hang-timeout` sets it) or 1800; 0 turns the hang doctor off.
            On PyTorch the collectives then wait at least this long plus 60 s.

    Raises:
        RuntimeError: naming the rank and the coordinator when the job could
            not be joined in time (on process 0, the ranks that never
            came), or when the coordinator's port is already in use.

    Example:

    >>> keras_dist.initialize()  # one process: nothing to join
    """
    coordinator, count, rank = resolve_cluster(job_addresses, num_processes, process_id)
    if timeout_seconds is None:
        timeout_seconds = _timeout_from_environment()
    if timeout_seconds <= 0:
        raise ValueError(
            f"`timeout_seconds` must be positive. Received: {timeout_seconds}"
        )
    heartbeat.configure(hang_timeout)  # validates it, before the backend starts
    if count == 1:
        asked = (job_addresses, num_processes, process_id)
        configured = any(value is not None for value in asked) or any(
            environment_value(name) is not None
            for name in (
                JOB_ADDRESSES_VARIABLE,
                NUM_PROCESSES_VARIABLE,
                PROCESS_ID_VARIABLE,
            )
        )
        # A cluster keras_dist detected gave a coordinator, even for one process.
        if coordinator is None and not configured and not _initialized:
            _join_detected_cluster(timeout_seconds)
        return
    if _initialized:
        if _initialized != {"coordinator": coordinator, "count": count, "rank": rank}:
            raise ValueError(
                f"keras_dist is already initialized as {_initialized}; it cannot "
                f"join another job. Received: coordinator={coordinator}, "
                f"num_processes={count}, process_id={rank}"
            )
        return
    # Every process checks in at the coordinator first: a process that never
    # comes, or a port already in use, is then a Python error naming the ranks
    # and the address, not JAX's abort or TensorFlow's endless wait.
    check_in_everyone(coordinator, count, rank, timeout_seconds=timeout_seconds)
    if rank != 0:
        # Process 0 starts the backend's coordinator just after letting the
        # others go; some backends abort (JAX) when it is not there yet.
        _wait_for_coordinator(coordinator, rank, count, timeout_seconds=timeout_seconds)
    get_adapter().initialize(coordinator, count, rank, timeout_seconds=timeout_seconds)
    _initialized.update({"coordinator": coordinator, "count": count, "rank": rank})
    # One writer from now on: `model.save` and Keras' file-writing callbacks
    # write on process 0 only, inside `fit` or not.
    from keras_dist import saving  # noqa: PLC0415 (saving imports this module)

    saving.install()
    # After the backend: it may replace the SIGTERM handler when it starts.
    lifecycle.install(rank)


def _join_detected_cluster(timeout_seconds: float) -> None:
    """Nothing configured a job: let the backend's own cluster detection form
    one, as Keras lets JAX's (Cloud TPU, GKE...); else run as one process."""
    adapter = get_adapter()
    if not adapter.join_detected_cluster(timeout_seconds=timeout_seconds):
        return
    _initialized.update(
        {
            "coordinator": f"detected by {adapter.name}",
            "count": adapter.num_processes(),
            "rank": adapter.process_id(),
        }
    )
    from keras_dist import saving  # noqa: PLC0415 (saving imports this module)

    saving.install()
    if adapter.num_processes() > 1:
        lifecycle.install(adapter.process_id())


_warned: set[tuple[type[Warning], str]] = set()


def warn_once(message: str, category: type[Warning], stacklevel: int = 2) -> None:
    """Warn once per message, and only on process 0 of a multi-process job."""
    key = (category, message)
    if key in _warned or process_id() != 0:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
