"""Kubernetes: Kubeflow Trainer's JAX and torch runtimes, and JobSet."""

from __future__ import annotations

import os

from keras_dist.cluster.addresses import join_address, split_address
from keras_dist.cluster.environments.base import (
    JAX_VARIABLES,
    JOB_COMPLETION_INDEX_VARIABLE,
    JOBSET_VARIABLES,
    PET_NPROC_PER_NODE_VARIABLE,
    PET_VARIABLES,
    SLURM_COORDINATOR_PORT_VARIABLE,
    ClusterEnvironment,
    at_least_one,
    environment_int,
    environment_value,
    fixed_coordinator_port,
    port_variable,
    rank_in_range,
    require_all,
)


class JaxEnvironment(ClusterEnvironment):
    """`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`:
    what Kubeflow Trainer's JAX runtime (`jax-distributed`, `mlPolicy.jax`)
    sets on every pod of a TrainJob (`<trainjob>-node-0-0.<trainjob>:29500`,
    the node count, the pod's Job completion index).

    Detected when `JAX_NUM_PROCESSES` or `JAX_PROCESS_ID` is set; then all
    three must be. `JAX_COORDINATOR_ADDRESS` alone is left to JAX's own
    cluster detection (`jax.distributed.initialize()`, which reads it), as
    before. Backend-neutral: a PyTorch or TensorFlow script in such a pod
    joins its job the same way.
    """

    num_processes_source = "JAX_NUM_PROCESSES"
    process_id_source = "JAX_PROCESS_ID"
    variables = JAX_VARIABLES

    @staticmethod
    def detect() -> bool:
        return any(
            environment_value(name) for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        )

    def coordinator_address(self) -> str:
        require_all("JAX job", JAX_VARIABLES)
        address = environment_value("JAX_COORDINATOR_ADDRESS")
        try:
            split_address(address)
        except ValueError:
            raise ValueError(
                "JAX_COORDINATOR_ADDRESS must be 'host:port'. Received: "
                f"JAX_COORDINATOR_ADDRESS={address!r}"
            ) from None
        return address

    def num_processes(self) -> int:
        require_all("JAX job", JAX_VARIABLES)
        return at_least_one("JAX_NUM_PROCESSES", environment_int("JAX_NUM_PROCESSES"))

    def process_id(self) -> int:
        require_all("JAX job", JAX_VARIABLES)
        return rank_in_range(
            "JAX_PROCESS_ID",
            environment_int("JAX_PROCESS_ID"),
            "JAX_NUM_PROCESSES",
            self.num_processes(),
        )


class KubeflowTorchEnvironment(ClusterEnvironment):
    """torchrun's `PET_*` defaults without torchrun: what Kubeflow Trainer's
    torch runtime (`torch-distributed`, `mlPolicy.torch`) sets on every pod
    of a TrainJob, for a script started directly (`python train.py`).

    `PET_NNODES` pods, each one process: the rank is `PET_NODE_RANK` (the
    pod's Job completion index) and the coordinator `PET_MASTER_ADDR:
    PET_MASTER_PORT` (`<trainjob>-node-0-0.<trainjob>:29500`). Detected when
    `PET_NNODES` or `PET_NODE_RANK` is set; then all four must be, and
    `PET_NPROC_PER_NODE` must be 1 (or unset): more processes per pod need a
    launcher, `torchrun` (which reads the `PET_*` variables and sets `RANK`,
    detected first) or `keras-dist launch`.
    """

    num_processes_source = "PET_NNODES"
    process_id_source = "PET_NODE_RANK"
    variables = (*PET_VARIABLES, PET_NPROC_PER_NODE_VARIABLE)

    @staticmethod
    def detect() -> bool:
        return any(environment_value(name) for name in ("PET_NNODES", "PET_NODE_RANK"))

    def _check(self) -> None:
        require_all("Kubeflow torch runtime (PET_*)", PET_VARIABLES)
        per_node = environment_value(PET_NPROC_PER_NODE_VARIABLE)
        if per_node not in (None, "1"):
            raise ValueError(
                f"{PET_NPROC_PER_NODE_VARIABLE}={per_node!r} asks for that many "
                "processes per pod (Kubeflow's torch runtime sets it from the "
                "TrainJob's `trainer.numProcPerNode`, else from the pod's GPUs or "
                "CPUs), but this script was started directly, as one process. "
                "Set `numProcPerNode: 1` in the TrainJob's trainer, or start the "
                "script with torchrun (it reads the PET_* variables) or with "
                f"`keras-dist launch --nproc-per-node N`. Received: "
                f"{PET_NPROC_PER_NODE_VARIABLE}={per_node!r}, "
                f"PET_NNODES={os.environ.get('PET_NNODES')!r}"
            )

    def coordinator_address(self) -> str:
        self._check()
        host = environment_value("PET_MASTER_ADDR")
        port = port_variable("PET_MASTER_PORT", environment_value("PET_MASTER_PORT"))
        return join_address(host, port)

    def num_processes(self) -> int:
        self._check()
        return at_least_one("PET_NNODES", environment_int("PET_NNODES"))

    def process_id(self) -> int:
        self._check()
        return rank_in_range(
            "PET_NODE_RANK",
            environment_int("PET_NODE_RANK"),
            "PET_NNODES",
            self.num_processes(),
        )


class JobSetEnvironment(ClusterEnvironment):
    """A pod of a JobSet (`jobset.x-k8s.io`) whose replicated jobs run one pod
    per Job, told about its job by JobSet's own pod annotations, projected
    into the environment with the Downward API (`fieldRef:
    metadata.annotations['jobset.sigs.k8s.io/...']`, see
    `integrations/kubernetes/jobset.yaml`):

    - `JOBSET_COORDINATOR`: `jobset.sigs.k8s.io/coordinator`, the stable host
      name `<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>`
      JobSet gives the pod named by the JobSet's `spec.coordinator`;
    - `JOBSET_GLOBAL_REPLICAS`: `jobset.sigs.k8s.io/global-replicas`, the
      Jobs of all replicated jobs (the process count);
    - `JOBSET_JOB_GLOBAL_INDEX`: `jobset.sigs.k8s.io/job-global-index`, this
      Job's index across them (the rank).

    The port is `KERAS_DIST_COORDINATOR_PORT` (default 12355), as on SLURM.
    Detected when `JOBSET_COORDINATOR` or `JOBSET_JOB_GLOBAL_INDEX` is set;
    then all three must be. A pod whose `JOB_COMPLETION_INDEX` (set by
    Kubernetes in Indexed Jobs) is not 0 belongs to a Job of several pods,
    which the annotations cannot number: an error.
    """

    num_processes_source = "JOBSET_GLOBAL_REPLICAS"
    process_id_source = "JOBSET_JOB_GLOBAL_INDEX"
    variables = (
        *JOBSET_VARIABLES,
        JOB_COMPLETION_INDEX_VARIABLE,
        SLURM_COORDINATOR_PORT_VARIABLE,
    )

    @staticmethod
    def detect() -> bool:
        return any(
            environment_value(name)
            for name in ("JOBSET_COORDINATOR", "JOBSET_JOB_GLOBAL_INDEX")
        )

    def _check(self) -> None:
        require_all("JobSet", JOBSET_VARIABLES)
        pod_index = environment_int(JOB_COMPLETION_INDEX_VARIABLE)
        if pod_index not in (None, 0):
            raise ValueError(
                "keras_dist numbers JobSet pods by their Job "
                "(jobset.sigs.k8s.io/job-global-index), one pod per Job, but this "
                f"pod is pod {pod_index} of its Job. Give the replicated job "
                "`replicas: N` with `parallelism: 1` and `completions: 1`. "
                f"Received: {JOB_COMPLETION_INDEX_VARIABLE}={pod_index}, "
                "JOBSET_JOB_GLOBAL_INDEX="
                f"{os.environ.get('JOBSET_JOB_GLOBAL_INDEX')!r}"
            )

    def coordinator_address(self) -> str:
        self._check()
        host = environment_value("JOBSET_COORDINATOR")
        return join_address(host, fixed_coordinator_port())

    def num_processes(self) -> int:
        self._check()
        return at_least_one(
            "JOBSET_GLOBAL_REPLICAS", environment_int("JOBSET_GLOBAL_REPLICAS")
        )

    def process_id(self) -> int:
        self._check()
        return rank_in_range(
            "JOBSET_JOB_GLOBAL_INDEX",
            environment_int("JOBSET_JOB_GLOBAL_INDEX"),
            "JOBSET_GLOBAL_REPLICAS",
            self.num_processes(),
        )
