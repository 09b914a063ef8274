"""An `srun` task: SLURM's task rank, task count and node list."""

from __future__ import annotations

import os

from keras_dist.cluster.addresses import join_address
from keras_dist.cluster.environments.base import (
    SLURM_COORDINATOR_PORT_VARIABLE,
    SLURM_NODELIST_VARIABLES,
    SLURM_TASK_COUNT_VARIABLES,
    ClusterEnvironment,
    at_least_one,
    environment_int,
    environment_value,
    fixed_coordinator_port,
    rank_in_range,
)
from keras_dist.cluster.hostlist import expand_hostlist


class SlurmEnvironment(ClusterEnvironment):
    """A task started by `srun` (directly or from an `sbatch` script).

    Detected when `SLURM_PROCID` and a task count (`SLURM_STEP_NUM_TASKS` or
    `SLURM_NTASKS`) are set: an `salloc` shell has only `SLURM_NTASKS` and an
    `sbatch` script without `--ntasks` only `SLURM_PROCID`, and both are
    single processes. The process count is the step's,
    `SLURM_STEP_NUM_TASKS`, which `srun` always sets, else `SLURM_NTASKS`:
    `srun --preserve-env` (`-E`) keeps the allocation's `SLURM_NTASKS` (or
    none, for an allocation made without `--ntasks`). The coordinator is the
    first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`) on port
    `KERAS_DIST_COORDINATOR_PORT`, default 12355. The port is fixed because
    every task must compute the same address without talking to the others;
    set `KERAS_DIST_COORDINATOR_PORT` when two jobs share that host or the
    port is taken.

    Run the script under `srun`: a script started directly by an `sbatch`
    script with `--ntasks=4` sees `SLURM_PROCID=0`, `SLURM_NTASKS=4` and waits
    for three processes that never come (until the initialize timeout). Set
    `KERAS_DISTRIBUTION_NUM_PROCESSES=1` to run such a script alone.
    """

    process_id_source = "SLURM_PROCID"
    variables = (
        "SLURM_PROCID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        *SLURM_NODELIST_VARIABLES,
        SLURM_COORDINATOR_PORT_VARIABLE,
    )

    @staticmethod
    def detect() -> bool:
        return environment_value("SLURM_PROCID") is not None and any(
            environment_value(name) for name in SLURM_TASK_COUNT_VARIABLES
        )

    @property
    def num_processes_source(self) -> str:
        """The variable the process count comes from."""
        for name in SLURM_TASK_COUNT_VARIABLES:
            if environment_value(name) is not None:
                return name
        return "SLURM_NTASKS"

    def coordinator_address(self) -> str:
        for variable in SLURM_NODELIST_VARIABLES:
            nodelist = environment_value(variable)
            if nodelist is not None:
                host = expand_hostlist(nodelist, name=variable)[0]
                break
        else:
            raise ValueError(
                "A SLURM task needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to "
                "find the coordinator's host; neither is set. Received: "
                f"SLURM_PROCID={os.environ.get('SLURM_PROCID')!r}, "
                f"SLURM_NTASKS={os.environ.get('SLURM_NTASKS')!r}"
            )
        return join_address(host, fixed_coordinator_port())

    def num_processes(self) -> int:
        name = self.num_processes_source
        return at_least_one(name, environment_int(name))

    def process_id(self) -> int:
        return rank_in_range(
            "SLURM_PROCID",
            environment_int("SLURM_PROCID"),
            self.num_processes_source,
            self.num_processes(),
        )

    def local_process_id(self) -> int | None:
        local_id = environment_int("SLURM_LOCALID")
        if local_id is not None and local_id < 0:
            raise ValueError(
                "SLURM_LOCALID must not be negative. Received: "
                f"SLURM_LOCALID={local_id}"
            )
        return local_id
