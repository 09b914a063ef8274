"""Devices, processes and joining a multi-process job."""

from __future__ import annotations

import socket
import time

from keras_dist.backends import get_adapter
from keras_dist.cluster.addresses import split_address
from keras_dist.cluster.environments import (
    environment_value,
)
from keras_dist.cluster.resolve import (
    JOB_ADDRESSES_VARIABLE,
    NUM_PROCESSES_VARIABLE,
    PROCESS_ID_VARIABLE,
    resolve_cluster,
)
from keras_dist.cluster.roll_call import check_in_everyone
from keras_dist.common import job
from keras_dist.common.job import TIMEOUT_VARIABLE
from keras_dist.faults import heartbeat, lifecycle

_DEVICE_TYPES = ("cpu", "gpu", "tpu")


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
    the process runs alone. Call it first, before any backend work: a process
    that a launcher or cluster started as one of several and that never
    called it cannot run a distributed `fit`, `evaluate` or `predict`, a
    `kd.Checkpoint` or `kd.export` (they raise, naming this fix, instead of
    running alone: `keras_dist.runtime.join_check`). A job the backend
    already joined (the script called `jax.distributed.initialize()` first)
    is taken as it is, when it is the job keras_dist finds.

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
        timeout_seconds = job.timeout_seconds()
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
        if coordinator is None and not configured and not job.joined():
            _join_detected_cluster(timeout_seconds)
        job.record_initialize()
        return
    joined = job.joined()
    if joined:
        if joined != {"coordinator": coordinator, "count": count, "rank": rank}:
            raise ValueError(
                f"keras_dist is already initialized as {joined}; it cannot "
                f"join another job. Received: coordinator={coordinator}, "
                f"num_processes={count}, process_id={rank}"
            )
        job.record_initialize()
        return
    adapter = get_adapter()
    own = adapter.joined_on_its_own()
    if own is not None:
        # The script joined through the backend first, as Keras' multi-host
        # guide does (`jax.distributed.initialize()`): nothing more to join,
        # and its coordinator already holds the port a roll call would take.
        if own != (count, rank):
            raise ValueError(
                f"The {adapter.name} backend already joined a job as process "
                f"{own[1]} of {own[0]} (the script initialized it itself), but "
                f"keras_dist found process {rank} of {count}. Call "
                "`kd.initialize()` alone, or give both the same job. Received: "
                f"num_processes={count}, process_id={rank}"
            )
        job.record_join(f"joined by {adapter.name}", count, rank)
        job.record_initialize()
        lifecycle.install(rank)
        return
    # Every process checks in at the coordinator first: a process that never
    # comes, or a port already in use, is then a Python error naming the ranks
    # and the address, not JAX's abort or TensorFlow's endless wait.
    check_in_everyone(coordinator, count, rank, timeout_seconds=timeout_seconds)
    if rank != 0:
        # Process 0 starts the backend's coordinator just after letting the
        # others go; some backends abort (JAX) when it is not there yet.
        _wait_for_coordinator(coordinator, rank, count, timeout_seconds=timeout_seconds)
    adapter.initialize(coordinator, count, rank, timeout_seconds=timeout_seconds)
    # Its hooks switch on one writer from now on: `model.save` and Keras'
    # file-writing callbacks write on process 0 only, inside `fit` or not
    # (`keras_dist.training.saving`).
    job.record_join(coordinator, count, rank)
    job.record_initialize()
    # After the backend: it may replace the SIGTERM handler when it starts.
    lifecycle.install(rank)


def _join_detected_cluster(timeout_seconds: float) -> None:
    """Nothing configured a job: let the backend's own cluster detection form
    one, as Keras lets JAX's (Cloud TPU, GKE...); else run as one process."""
    adapter = get_adapter()
    if not adapter.join_detected_cluster(timeout_seconds=timeout_seconds):
        return
    job.record_join(
        f"detected by {adapter.name}", adapter.num_processes(), adapter.process_id()
    )
    if adapter.num_processes() > 1:
        lifecycle.install(adapter.process_id())
