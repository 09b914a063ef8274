"""The pieces every cluster environment shares: the variables they read,
the parsers that check them, and the `ClusterEnvironment` interface."""

from __future__ import annotations

import abc
import os
import re

from keras_dist.cluster.addresses import is_port

DEFAULT_SLURM_COORDINATOR_PORT = 12355


SLURM_COORDINATOR_PORT_VARIABLE = "KERAS_DIST_COORDINATOR_PORT"


#: Set on every Ray Train worker by `keras_dist_ray`'s backend: `host:port` of
#: the coordinator, on the node of the worker of world rank 0.
RAY_COORDINATOR_VARIABLE = "KERAS_DIST_RAY_COORDINATOR_ADDRESS"


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")


# The step's task count first: `srun --preserve-env` keeps the allocation's.
SLURM_TASK_COUNT_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


TF_CONFIG_TASK_TYPES = ("chief", "worker")


#: What Kubeflow Trainer's JAX runtime (`jax-distributed`) sets on every pod.
JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


#: torchrun's `PET_*` defaults, which Kubeflow Trainer's torch runtime
#: (`torch-distributed`) sets on every pod.
PET_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


PET_NPROC_PER_NODE_VARIABLE = "PET_NPROC_PER_NODE"


#: JobSet's pod annotations `jobset.sigs.k8s.io/coordinator`, `.../global-replicas`
#: and `.../job-global-index`, as a manifest projects them into the environment
#: with the Downward API (`integrations/kubernetes/jobset.yaml`).
JOBSET_VARIABLES = (
    "JOBSET_COORDINATOR",
    "JOBSET_GLOBAL_REPLICAS",
    "JOBSET_JOB_GLOBAL_INDEX",
)


#: A Cloud TPU slice's hosts in worker order, as JAX's Cloud TPU detection
#: reads them (the first one set counts), and this host's index among them.
CLOUD_TPU_HOSTS_VARIABLES = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
CLOUD_TPU_WORKER_ID_VARIABLES = ("TPU_WORKER_ID", "CLOUD_TPU_TASK_ID")


#: Several slices joined by the data-center network (multislice).
CLOUD_TPU_SLICE_VARIABLES = (
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


#: The coordinator's port on a Cloud TPU slice: keras_dist's variable, else
#: JAX's, else JAX's fixed port.
CLOUD_TPU_PORT_VARIABLES = (SLURM_COORDINATOR_PORT_VARIABLE, "JAX_COORDINATOR_PORT")
DEFAULT_CLOUD_TPU_COORDINATOR_PORT = 8482


#: Set by Kubernetes in every pod of an Indexed Job: the pod's index in its Job.
JOB_COMPLETION_INDEX_VARIABLE = "JOB_COMPLETION_INDEX"


#: Every variable a cluster environment reads (tests clear them).
ENVIRONMENT_VARIABLES = (
    *TORCHRUN_VARIABLES,
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    *SLURM_NODELIST_VARIABLES,
    SLURM_COORDINATOR_PORT_VARIABLE,
    "TF_CONFIG",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODEID",
    *JAX_VARIABLES,
    *PET_VARIABLES,
    PET_NPROC_PER_NODE_VARIABLE,
    *JOBSET_VARIABLES,
    JOB_COMPLETION_INDEX_VARIABLE,
    RAY_COORDINATOR_VARIABLE,
    *CLOUD_TPU_HOSTS_VARIABLES,
    *CLOUD_TPU_WORKER_ID_VARIABLES,
    *CLOUD_TPU_SLICE_VARIABLES,
    "JAX_COORDINATOR_PORT",
)


# -- small parsers shared with the runtime --------------------------------------
def environment_value(name: str) -> str | None:
    """The stripped value of an environment variable; None when unset or empty."""
    return os.environ.get(name, "").strip() or None


def environment_int(name: str) -> int | None:
    """An environment variable holding a whole number, or None when unset."""
    raw = environment_value(name)
    if raw is None:
        return None
    if not re.fullmatch(r"-?[0-9]+", raw):
        raise ValueError(f"{name} must be a whole number. Received: {name}={raw!r}")
    return int(raw)


def port_variable(name: str, raw: str) -> int:
    if not is_port(raw):
        raise ValueError(
            f"{name} must be a port from 1 to 65535. Received: {name}={raw!r}"
        )
    return int(raw)


def fixed_coordinator_port() -> int:
    """`KERAS_DIST_COORDINATOR_PORT`, else 12355: the port of clusters whose
    processes must compute the coordinator's address alone (SLURM, JobSet)."""
    raw_port = environment_value(SLURM_COORDINATOR_PORT_VARIABLE)
    if raw_port is None:
        return DEFAULT_SLURM_COORDINATOR_PORT
    return port_variable(SLURM_COORDINATOR_PORT_VARIABLE, raw_port)


def at_least_one(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be at least 1. Received: {name}={value}")
    return value


def rank_in_range(rank_name: str, rank: int, size_name: str, size: int) -> int:
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_name} must be in [0, {size_name} - 1]. Received: "
            f"{rank_name}={rank}, {size_name}={size}"
        )
    return rank


def require_all(kind: str, names: tuple[str, ...]) -> None:
    """Raise a ValueError naming the missing ones when not all of `names` are
    set, with the values of those that are."""
    missing = [name for name in names if environment_value(name) is None]
    if missing:
        present = ", ".join(
            f"{name}={os.environ[name]!r}" for name in names if name not in missing
        )
        raise ValueError(
            f"{kind} variables are incomplete: {', '.join(names)} must all be "
            f"set, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"missing. Received: {present or 'none of them'}"
        )


# -- environments ---------------------------------------------------------------
class ClusterEnvironment(abc.ABC):
    """One way of launching processes, read from the environment it sets.

    `detect()` only says whether the environment's variables are present;
    the other methods read and validate them and raise a `ValueError` naming
    the variables and values when they are incomplete or inconsistent.
    """

    #: The variables the process count and rank come from, for messages.
    num_processes_source: str = ""
    process_id_source: str = ""
    #: Every variable this environment reads (`keras-dist env` shows them).
    variables: tuple[str, ...] = ()

    @staticmethod
    @abc.abstractmethod
    def detect() -> bool:
        """Whether this process' environment was set by this launcher."""

    @abc.abstractmethod
    def coordinator_address(self) -> str:
        """`"host:port"` of process 0, which every process connects to."""

    @abc.abstractmethod
    def num_processes(self) -> int:
        """Processes in the job."""

    @abc.abstractmethod
    def process_id(self) -> int:
        """This process' rank, from 0 to `num_processes() - 1`."""

    def local_process_id(self) -> int | None:
        """This process' rank among the processes of its host, when known."""
        return None
