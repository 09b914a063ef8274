"""Which job this process belongs to: explicit arguments, then the
`KERAS_DISTRIBUTION_*` variables, then the cluster that launched it.

Standard library only, so that `keras-dist env` says what `kd.initialize()`
would join without starting a backend.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

from keras_dist.cluster.addresses import split_address
from keras_dist.cluster.environments import (
    detect_cluster,
    environment_int,
    environment_value,
)

JOB_ADDRESSES_VARIABLE = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
NUM_PROCESSES_VARIABLE = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "KERAS_DISTRIBUTION_PROCESS_ID"


def _int_or_none(name: str, value: object) -> int | None:
    """An explicit argument: an int or None; anything else, a fraction or a
    string included, is an error."""
    if value is None:
        return None
    # numbers.Integral: Python's int and NumPy's integer types alike.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int. Received: {name}={value!r}")
    return int(value)


class ResolvedJob(NamedTuple):
    """The job `resolve_job` found, and where its count and rank came from."""

    coordinator: str | None
    count: int
    rank: int
    #: What gave the process count and the rank: an argument, a variable such
    #: as `WORLD_SIZE`, or a cluster's own source ("Ray Train's world size").
    count_source: str
    rank_source: str


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

    >>> resolve_cluster("10.0.0.1:1234", 4, 3)
    ('10.0.0.1:1234', 4, 3)
    """
    coordinator, count, rank, _, _ = resolve_job(
        job_addresses, num_processes, process_id
    )
    return coordinator, count, rank


def resolve_job(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ResolvedJob:
    """`resolve_cluster`, with where the process count and the rank came from
    (for messages that name the variables to change)."""
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
        count, count_source = 1, "no cluster detected"
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
        rank_source = "a job of one process"
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
    coordinator = addresses[0] if addresses else None
    return ResolvedJob(coordinator, count, rank, count_source, rank_source)
