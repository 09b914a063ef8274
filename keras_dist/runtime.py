"""Devices, processes and joining a multi-process job."""

from __future__ import annotations

import os

import numpy as np

from keras_dist.backends import get_adapter

_DEVICE_TYPES = ("cpu", "gpu", "tpu")
DEFAULT_INIT_TIMEOUT_SECONDS = 300.0

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


def _env_int(name: str) -> int | None:
    """An environment variable holding a whole number, or None when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.lstrip("-").isdigit():
        raise ValueError(f"{name} must be a whole number. Received: {name}={raw!r}")
    return int(raw)


def _validate_address(address: str) -> str:
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "Job addresses look like 'host:port' with a port from 1 to 65535. "
            f"Received: {address!r}"
        )
    return address


def resolve_cluster(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str | None, int, int]:
    """Work out `(coordinator_address, num_processes, process_id)`.

    Explicit arguments win; the `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
    `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`
    variables fill what is missing. Without either, the job is one process.
    """
    env = os.environ
    if job_addresses is None:
        job_addresses = env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES") or None
    num_processes = _int_or_none("num_processes", num_processes)
    process_id = _int_or_none("process_id", process_id)
    if num_processes is None:
        num_processes = _env_int("KERAS_DISTRIBUTION_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("KERAS_DISTRIBUTION_PROCESS_ID")

    addresses: list[str] = []
    if job_addresses is not None:
        if not isinstance(job_addresses, str):
            raise TypeError(
                "`job_addresses` must be a comma-separated string of 'host:port'. "
                f"Received: job_addresses={job_addresses!r}"
            )
        addresses = [_validate_address(a.strip()) for a in job_addresses.split(",")]
    if num_processes is None:
        num_processes = len(addresses) if len(addresses) > 1 else 1
    if num_processes < 1:
        raise ValueError(
            "`num_processes` must be at least 1. Received: "
            f"num_processes={num_processes}"
        )
    if len(addresses) > 1 and len(addresses) != num_processes:
        raise ValueError(
            f"`job_addresses` lists {len(addresses)} jobs but `num_processes` is "
            f"{num_processes}. Received: job_addresses={job_addresses!r}"
        )
    if process_id is None:
        if num_processes > 1:
            raise ValueError(
                f"A job of {num_processes} processes needs this process' "
                "`process_id` (or KERAS_DISTRIBUTION_PROCESS_ID)."
            )
        process_id = 0
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"`process_id` must be in [0, {num_processes - 1}]. Received: "
            f"process_id={process_id}, num_processes={num_processes}"
        )
    if num_processes > 1 and not addresses:
        raise ValueError(
            f"A job of {num_processes} processes needs the coordinator's "
            "'host:port' in `job_addresses` (or KERAS_DISTRIBUTION_JOB_ADDRESSES)."
        )
    return (addresses[0] if addresses else None), num_processes, process_id


def initialize(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_seconds: float | None = None,
) -> None:
    """Join a multi-process job; a no-op for a single process.

    Args:
        job_addresses: `"host:port"` of the coordinator (process 0), or every
            process' address separated by commas (the first is the coordinator).
        num_processes: processes in the job.
        process_id: this process' rank, `0 <= process_id < num_processes`.
        timeout_seconds: how long to wait for the other processes before
            failing with an error naming the coordinator. Defaults to
            `KERAS_DIST_INIT_TIMEOUT` or 300.

    Example:

    >>> keras_dist.initialize()  # one process: nothing to join
    """
    coordinator, count, rank = resolve_cluster(job_addresses, num_processes, process_id)
    if timeout_seconds is None:
        raw = os.environ.get("KERAS_DIST_INIT_TIMEOUT", "")
        try:
            timeout_seconds = float(raw) if raw else DEFAULT_INIT_TIMEOUT_SECONDS
        except ValueError:
            raise ValueError(
                "KERAS_DIST_INIT_TIMEOUT must be a positive number of seconds. "
                f"Received: KERAS_DIST_INIT_TIMEOUT={raw!r}"
            ) from None
    if timeout_seconds <= 0:
        raise ValueError(
            f"`timeout_seconds` must be positive. Received: {timeout_seconds}"
        )
    if count == 1:
        return
    if _initialized:
        if _initialized != {"coordinator": coordinator, "count": count, "rank": rank}:
            raise ValueError(
                f"keras_dist is already initialized as {_initialized}; it cannot "
                f"join another job. Received: coordinator={coordinator}, "
                f"num_processes={count}, process_id={rank}"
            )
        return
    get_adapter().initialize(coordinator, count, rank, timeout_seconds=timeout_seconds)
    _initialized.update({"coordinator": coordinator, "count": count, "rank": rank})
