"""A Cloud TPU slice's worker: its hosts, its worker id, its slice."""

from __future__ import annotations

from keras_dist.cluster.addresses import join_address, split_address
from keras_dist.cluster.environments.base import (
    CLOUD_TPU_HOSTS_VARIABLES,
    CLOUD_TPU_PORT_VARIABLES,
    CLOUD_TPU_SLICE_VARIABLES,
    CLOUD_TPU_WORKER_ID_VARIABLES,
    DEFAULT_CLOUD_TPU_COORDINATOR_PORT,
    ClusterEnvironment,
    at_least_one,
    environment_int,
    environment_value,
    port_variable,
    rank_in_range,
)


def _host(entry: str) -> str:
    """`entry` without its port: `TPU_PROCESS_ADDRESSES` lists `host:port`
    (the TPU runtime's port, not the coordinator's), `TPU_WORKER_HOSTNAMES`
    and `MEGASCALE_COORDINATOR_ADDRESS` a host with or without one."""
    try:
        return split_address(entry)[0]
    except ValueError:
        return entry


def _first_set(names: tuple[str, ...]) -> str:
    """The first of `names` that is set (else the first, for messages)."""
    for name in names:
        if environment_value(name) is not None:
            return name
    return names[0]


class CloudTpuEnvironment(ClusterEnvironment):
    """A worker (host) of a Cloud TPU slice: its hosts, its worker id and,
    for several slices, `MEGASCALE_*`.

    What JAX's own Cloud TPU detection reads on GKE
    (`jax._src.clusters.cloud_tpu_cluster`): the slice's hosts in worker
    order, `TPU_PROCESS_ADDRESSES` else `TPU_WORKER_HOSTNAMES`
    (comma-separated), and this host's index among them, `TPU_WORKER_ID`
    (else `CLOUD_TPU_TASK_ID`). Several slices joined
    by the data-center network (multislice) add `MEGASCALE_NUM_SLICES`,
    `MEGASCALE_SLICE_ID` and `MEGASCALE_COORDINATOR_ADDRESS`: the job has
    hosts x slices processes, a process' rank is its worker id plus its
    slice id times the hosts of a slice, as in JAX.

    The coordinator is the first host (or the host of
    `MEGASCALE_COORDINATOR_ADDRESS`) on port `KERAS_DIST_COORDINATOR_PORT`,
    else `JAX_COORDINATOR_PORT` (the variable JAX's detection reads), else
    8482, JAX's fixed port: every worker must compute the same address
    without talking to the others. Detected when `TPU_PROCESS_ADDRESSES` or
    `TPU_WORKER_HOSTNAMES` is set; then the worker id must be. On a Cloud
    TPU VM started with `gcloud` these come from the VM's metadata server,
    not the environment: with none of them set, `keras_dist.initialize()`
    leaves the job to JAX's detection, which asks the metadata server.
    """

    variables = (
        *CLOUD_TPU_HOSTS_VARIABLES,
        *CLOUD_TPU_WORKER_ID_VARIABLES,
        *CLOUD_TPU_SLICE_VARIABLES,
        *CLOUD_TPU_PORT_VARIABLES,
    )

    @staticmethod
    def detect() -> bool:
        """A hosts variable naming several hosts, or one beside a worker id or
        several slices. One host alone (`TPU_WORKER_HOSTNAMES=localhost`, as
        single-host set-ups of libtpu export) is no job of several."""
        name = next(
            (name for name in CLOUD_TPU_HOSTS_VARIABLES if environment_value(name)),
            None,
        )
        if name is None:
            return False
        hosts = [entry for entry in environment_value(name).split(",") if entry.strip()]
        return (
            len(hosts) > 1
            or any(environment_value(n) for n in CLOUD_TPU_WORKER_ID_VARIABLES)
            or environment_value("MEGASCALE_NUM_SLICES") not in (None, "1")
        )

    @property
    def num_processes_source(self) -> str:
        """The variables the process count comes from."""
        hosts = _first_set(CLOUD_TPU_HOSTS_VARIABLES)
        if environment_value("MEGASCALE_NUM_SLICES") is None:
            return hosts
        return f"{hosts} x MEGASCALE_NUM_SLICES"

    @property
    def process_id_source(self) -> str:
        """The variables the rank comes from."""
        worker = _first_set(CLOUD_TPU_WORKER_ID_VARIABLES)
        if environment_value("MEGASCALE_SLICE_ID") is None:
            return worker
        return f"{worker} + MEGASCALE_SLICE_ID x hosts"

    def hosts(self) -> list[str]:
        """The slice's hosts, in worker order."""
        name = _first_set(CLOUD_TPU_HOSTS_VARIABLES)
        raw = environment_value(name)
        entries = [entry.strip() for entry in raw.split(",")]
        if not all(entries):
            raise ValueError(
                f"{name} must list the slice's hosts separated by commas, with "
                f"no empty entry. Received: {name}={raw!r}"
            )
        return [_host(entry) for entry in entries]

    def num_slices(self) -> int:
        slices = environment_int("MEGASCALE_NUM_SLICES")
        return 1 if slices is None else at_least_one("MEGASCALE_NUM_SLICES", slices)

    def slice_id(self) -> int:
        slice_id = environment_int("MEGASCALE_SLICE_ID")
        if slice_id is None:
            return 0
        return rank_in_range(
            "MEGASCALE_SLICE_ID", slice_id, "MEGASCALE_NUM_SLICES", self.num_slices()
        )

    def worker_id(self) -> int:
        """This host's index in its slice."""
        name = _first_set(CLOUD_TPU_WORKER_ID_VARIABLES)
        worker = environment_int(name)
        hosts_name = _first_set(CLOUD_TPU_HOSTS_VARIABLES)
        if worker is None:
            raise ValueError(
                f"A Cloud TPU worker needs its index among the slice's hosts: "
                f"{hosts_name} is set, but neither TPU_WORKER_ID nor "
                f"CLOUD_TPU_TASK_ID is. Received: {hosts_name}="
                f"{environment_value(hosts_name)!r}"
            )
        return rank_in_range(name, worker, f"len({hosts_name})", len(self.hosts()))

    def coordinator_address(self) -> str:
        megascale = environment_value("MEGASCALE_COORDINATOR_ADDRESS")
        host = _host(megascale) if megascale is not None else self.hosts()[0]
        name = _first_set(CLOUD_TPU_PORT_VARIABLES)
        raw_port = environment_value(name)
        if raw_port is None:
            return join_address(host, DEFAULT_CLOUD_TPU_COORDINATOR_PORT)
        return join_address(host, port_variable(name, raw_port))

    def num_processes(self) -> int:
        return len(self.hosts()) * self.num_slices()

    def process_id(self) -> int:
        return self.worker_id() + self.slice_id() * len(self.hosts())
