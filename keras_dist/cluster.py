"""Cluster environments: who launched this process, and where is process 0?

`keras_dist.initialize()` called without arguments asks, in this order:

1. its explicit arguments (`job_addresses`, `num_processes`, `process_id`);
2. `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES` and
   `KERAS_DISTRIBUTION_PROCESS_ID` (what `keras-dist launch` sets);
3. the first cluster environment below whose `detect()` says its variables
   are present:

   - `TorchrunEnvironment`: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
     `MASTER_PORT` (and `LOCAL_RANK`), set by torchrun and most launchers
     that imitate it;
   - `SlurmEnvironment`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else
     `SLURM_NTASKS`) and the node list of an `srun` task;
   - `JaxEnvironment`: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
     `JAX_PROCESS_ID` (Kubeflow Trainer's JAX runtime);
   - `KubeflowTorchEnvironment`: torchrun's `PET_NNODES`, `PET_NODE_RANK`,
     `PET_MASTER_ADDR`, `PET_MASTER_PORT` without torchrun (Kubeflow
     Trainer's torch runtime, one process per pod);
   - `JobSetEnvironment`: JobSet's coordinator, global-replicas and
     job-global-index annotations, projected into `JOBSET_*` variables;
   - `TFConfigEnvironment`: the `TF_CONFIG` JSON of TensorFlow clusters
     (Kubeflow TFJob, Vertex AI).

`RayEnvironment` (a Ray Train worker started by `keras_dist_ray.KerasTrainer`)
is asked before all of them: its signal is a live Ray Train worker context in
this very process, while the others' variables may be inherited by every Ray
worker from the environment its Ray node was started in (`srun ray start`
puts `SLURM_PROCID` into every worker) or set by another Ray trainer
(Ray's `TorchTrainer` sets `RANK` and `MASTER_ADDR`).

Levels 1 and 2 fill the three values one by one, and a value they give wins
over the cluster's even when the two disagree: `KERAS_DISTRIBUTION_NUM_PROCESSES=2`
inside an 8-task SLURM step makes a job of 2 processes, and tasks whose
`SLURM_PROCID` is 2 or more then fail with an error naming both values. The
cluster is only consulted for what levels 1 and 2 leave open.

torchrun comes before SLURM because `srun torchrun ...` sets both, and then
torchrun's `RANK`/`WORLD_SIZE` describe the training processes while the SLURM
variables describe the torchrun launchers. The Kubernetes ones follow SLURM
(a pod is no SLURM task, and a SLURM task that inherited Kubernetes variables
is one): the JAX runtime's `JAX_*` name the job outright; `PET_*` come after
torchrun, whose processes inherit them from their torchrun; JobSet's
annotations come after both, because a Kubeflow TrainJob is itself a JobSet
and its runtime's variables are the specific ones. `TF_CONFIG` comes last: it
is the least specific, and stale copies of it are common in notebooks.

Variables that are present but incomplete or inconsistent are an error naming
them and their values, never a silent single-process run.
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import re
import sys

DEFAULT_SLURM_COORDINATOR_PORT = 12355
SLURM_COORDINATOR_PORT_VARIABLE = "KERAS_DIST_COORDINATOR_PORT"
#: Set on every Ray Train worker by `keras_dist_ray`'s backend: `host:port` of
#: the coordinator, on the node of the worker of world rank 0.
RAY_COORDINATOR_VARIABLE = "KERAS_DIST_RAY_COORDINATOR_ADDRESS"

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
# The step's task count first: `srun --preserve-env` keeps the allocation's.
_SLURM_TASK_COUNT_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_TF_CONFIG_TASK_TYPES = ("chief", "worker")
#: What Kubeflow Trainer's JAX runtime (`jax-distributed`) sets on every pod.
_JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
#: torchrun's `PET_*` defaults, which Kubeflow Trainer's torch runtime
#: (`torch-distributed`) sets on every pod.
_PET_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
PET_NPROC_PER_NODE_VARIABLE = "PET_NPROC_PER_NODE"
#: JobSet's pod annotations `jobset.sigs.k8s.io/coordinator`, `.../global-replicas`
#: and `.../job-global-index`, as a manifest projects them into the environment
#: with the Downward API (`integrations/kubernetes/jobset.yaml`).
_JOBSET_VARIABLES = (
    "JOBSET_COORDINATOR",
    "JOBSET_GLOBAL_REPLICAS",
    "JOBSET_JOB_GLOBAL_INDEX",
)
#: Set by Kubernetes in every pod of an Indexed Job: the pod's index in its Job.
JOB_COMPLETION_INDEX_VARIABLE = "JOB_COMPLETION_INDEX"

#: Every variable a cluster environment reads (tests clear them).
ENVIRONMENT_VARIABLES = (
    *_TORCHRUN_VARIABLES,
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    *_SLURM_NODELIST_VARIABLES,
    SLURM_COORDINATOR_PORT_VARIABLE,
    "TF_CONFIG",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODEID",
    *_JAX_VARIABLES,
    *_PET_VARIABLES,
    PET_NPROC_PER_NODE_VARIABLE,
    *_JOBSET_VARIABLES,
    JOB_COMPLETION_INDEX_VARIABLE,
    RAY_COORDINATOR_VARIABLE,
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


def split_address(address: str) -> tuple[str, int]:
    """`"host:port"` (or `"[::1]:port"`) as `(host, port)`, validated.

    Example:

    >>> split_address("[::1]:1234")
    ('::1', 1234)
    """
    host, separator, port = address.rpartition(":")
    if not (separator and host and _is_port(port)):
        raise ValueError(
            "Job addresses look like 'host:port' with a port from 1 to 65535. "
            f"Received: {address!r}"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (`[::1]:1234`)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _is_port(raw: str) -> bool:
    # Not str.isdigit: it accepts digits such as "²" that int() rejects.
    return re.fullmatch(r"[0-9]+", raw) is not None and 0 < int(raw) < 65536


def _port(name: str, raw: str) -> int:
    if not _is_port(raw):
        raise ValueError(
            f"{name} must be a port from 1 to 65535. Received: {name}={raw!r}"
        )
    return int(raw)


def _fixed_coordinator_port() -> int:
    """`KERAS_DIST_COORDINATOR_PORT`, else 12355: the port of clusters whose
    processes must compute the coordinator's address alone (SLURM, JobSet)."""
    raw_port = environment_value(SLURM_COORDINATOR_PORT_VARIABLE)
    if raw_port is None:
        return DEFAULT_SLURM_COORDINATOR_PORT
    return _port(SLURM_COORDINATOR_PORT_VARIABLE, raw_port)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be at least 1. Received: {name}={value}")
    return value


def _rank_in_range(rank_name: str, rank: int, size_name: str, size: int) -> int:
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_name} must be in [0, {size_name} - 1]. Received: "
            f"{rank_name}={rank}, {size_name}={size}"
        )
    return rank


# -- SLURM host lists -----------------------------------------------------------
def expand_hostlist(nodelist: str, *, name: str = "nodelist") -> list[str]:
    """Every host of a SLURM host list, in order.

    Handles comma-separated items, bracketed ranges and lists (`node[01-03,07]`
    keeps the zero padding of the lower bound) and several bracket groups in one
    name (`rack[1-2]-node[1-2]`, expanded left to right).

    Args:
        nodelist: the compressed list, e.g. `SLURM_JOB_NODELIST`.
        name: what to call the list in errors (the variable it came from).

    Returns:
        The host names.

    Example:

    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist, name):
        hosts.extend(_expand_host_pattern(item, nodelist, name))
    return hosts


def _bad_hostlist(nodelist: str, name: str, why: str) -> ValueError:
    return ValueError(
        f"{name} is not a SLURM host list ({why}); expected e.g. "
        f"'node[01-03,07],gpu5'. Received: {name}={nodelist!r}"
    )


def _split_outside_brackets(nodelist: str, name: str) -> list[str]:
    items, current, depth = [], [], 0
    for character in nodelist.strip():
        if character == "[":
            depth += 1
            if depth > 1:
                raise _bad_hostlist(nodelist, name, "nested '['")
        elif character == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(nodelist, name, "']' without '['")
        if character == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(character)
    if depth:
        raise _bad_hostlist(nodelist, name, "'[' without ']'")
    items.append("".join(current))
    if any(not item for item in items):
        raise _bad_hostlist(nodelist, name, "an empty host name")
    return items


def _expand_host_pattern(item: str, nodelist: str, name: str) -> list[str]:
    # re.split with a capturing group alternates literal text and "[...]" groups.
    parts = re.split(r"(\[[^\]]*\])", item)
    choices = [
        _expand_range_group(part[1:-1], nodelist, name)
        if part.startswith("[")
        else [part]
        for part in parts
    ]
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_range_group(group: str, nodelist: str, name: str) -> list[str]:
    values: list[str] = []
    for span in group.split(","):
        low, _, high = span.partition("-")
        high = high or low
        if not (re.fullmatch("[0-9]+", low) and re.fullmatch("[0-9]+", high)):
            raise _bad_hostlist(nodelist, name, f"[{group}] is not a list of numbers")
        if int(low) > int(high):
            raise _bad_hostlist(nodelist, name, f"the range {span} runs backwards")
        values.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return values


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


class TorchrunEnvironment(ClusterEnvironment):
    """torchrun (`torch.distributed.run`) and launchers that imitate it.

    Detected when `RANK` or `WORLD_SIZE` is set; then `RANK`, `WORLD_SIZE`,
    `MASTER_ADDR` and `MASTER_PORT` must all be. `MASTER_ADDR`/`MASTER_PORT`
    alone are not enough: batch scripts often export them for other tools.
    """

    num_processes_source = "WORLD_SIZE"
    process_id_source = "RANK"
    variables = (*_TORCHRUN_VARIABLES, "LOCAL_RANK")

    @staticmethod
    def detect() -> bool:
        return any(environment_value(name) for name in ("RANK", "WORLD_SIZE"))

    def _required(self, name: str) -> str:
        missing = [key for key in _TORCHRUN_VARIABLES if environment_value(key) is None]
        if missing:
            present = ", ".join(
                f"{key}={os.environ[key]!r}"
                for key in _TORCHRUN_VARIABLES
                if key not in missing
            )
            raise ValueError(
                "torchrun-style variables are incomplete: "
                f"{', '.join(_TORCHRUN_VARIABLES)} must all be set, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"missing. Received: {present}"
            )
        return os.environ[name].strip()

    def coordinator_address(self) -> str:
        host = self._required("MASTER_ADDR")
        port = _port("MASTER_PORT", self._required("MASTER_PORT"))
        return join_address(host, port)

    def num_processes(self) -> int:
        self._required("WORLD_SIZE")
        return _positive("WORLD_SIZE", environment_int("WORLD_SIZE"))

    def process_id(self) -> int:
        self._required("RANK")
        return _rank_in_range(
            "RANK", environment_int("RANK"), "WORLD_SIZE", self.num_processes()
        )

    def local_process_id(self) -> int | None:
        local_rank = environment_int("LOCAL_RANK")
        if local_rank is not None and local_rank < 0:
            raise ValueError(
                f"LOCAL_RANK must not be negative. Received: LOCAL_RANK={local_rank}"
            )
        return local_rank


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
        *_SLURM_NODELIST_VARIABLES,
        SLURM_COORDINATOR_PORT_VARIABLE,
    )

    @staticmethod
    def detect() -> bool:
        return environment_value("SLURM_PROCID") is not None and any(
            environment_value(name) for name in _SLURM_TASK_COUNT_VARIABLES
        )

    @property
    def num_processes_source(self) -> str:
        """The variable the process count comes from."""
        for name in _SLURM_TASK_COUNT_VARIABLES:
            if environment_value(name) is not None:
                return name
        return "SLURM_NTASKS"

    def coordinator_address(self) -> str:
        for variable in _SLURM_NODELIST_VARIABLES:
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
        return join_address(host, _fixed_coordinator_port())

    def num_processes(self) -> int:
        name = self.num_processes_source
        return _positive(name, environment_int(name))

    def process_id(self) -> int:
        return _rank_in_range(
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


class TFConfigEnvironment(ClusterEnvironment):
    """A TensorFlow cluster described by `TF_CONFIG`.

    `TF_CONFIG` is JSON such as
    `{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
    "task": {"type": "worker", "index": 0}}`. The chief (when there is one)
    is process 0 and the coordinator, then the workers in order; other task
    types (`ps`, `evaluator`) are not part of a synchronous job and are an
    error.
    """

    num_processes_source = "TF_CONFIG"
    process_id_source = "TF_CONFIG"
    variables = ("TF_CONFIG",)

    @staticmethod
    def detect() -> bool:
        return environment_value("TF_CONFIG") is not None

    def _invalid(self, why: str) -> ValueError:
        raw = environment_value("TF_CONFIG")
        return ValueError(f"TF_CONFIG {why}. Received: TF_CONFIG={raw!r}")

    def _config(self) -> tuple[dict[str, list[str]], object]:
        """`TF_CONFIG`'s chief and worker address lists, and its task entry."""
        try:
            config = json.loads(environment_value("TF_CONFIG") or "")
        except json.JSONDecodeError as error:
            raise self._invalid(f"is not valid JSON ({error})") from None
        cluster = config.get("cluster") if isinstance(config, dict) else None
        if not isinstance(cluster, dict):
            raise self._invalid("must be a JSON object with a 'cluster' object")
        lists: dict[str, list[str]] = {}
        for task_type in _TF_CONFIG_TASK_TYPES:
            entries = cluster.get(task_type, [])
            if not isinstance(entries, list) or not all(
                isinstance(entry, str) for entry in entries
            ):
                raise self._invalid(
                    f"cluster.{task_type} must be a list of 'host:port' strings"
                )
            for entry in entries:
                try:
                    split_address(entry)
                except ValueError:
                    raise self._invalid(
                        f"cluster.{task_type} holds {entry!r}, not a 'host:port'"
                    ) from None
            lists[task_type] = entries
        if len(lists["chief"]) > 1:
            raise self._invalid("lists more than one cluster.chief")
        if not lists["chief"] and not lists["worker"]:
            raise self._invalid("lists no cluster.chief or cluster.worker addresses")
        return lists, config.get("task")

    def coordinator_address(self) -> str:
        lists, _ = self._config()
        return (lists["chief"] + lists["worker"])[0]

    def num_processes(self) -> int:
        lists, _ = self._config()
        return len(lists["chief"]) + len(lists["worker"])

    def tasks(self) -> list[tuple[str, int, str]]:
        """`(task type, index, "host:port")` of every process, in rank order."""
        lists, _ = self._config()
        return [
            (task_type, index, address)
            for task_type in _TF_CONFIG_TASK_TYPES
            for index, address in enumerate(lists[task_type])
        ]

    def process_id(self) -> int:
        lists, task = self._config()
        if not isinstance(task, dict):
            raise self._invalid("needs a 'task' object with 'type' and 'index'")
        task_type, index = task.get("type"), task.get("index")
        if task_type not in _TF_CONFIG_TASK_TYPES:
            raise self._invalid(
                f"task.type must be one of {list(_TF_CONFIG_TASK_TYPES)} "
                f"(keras_dist runs synchronous workers); got {task_type!r}"
            )
        if isinstance(index, bool) or not isinstance(index, int):
            raise self._invalid(f"task.index must be an int; got {index!r}")
        listed = len(lists[task_type])
        if not 0 <= index < listed:
            raise self._invalid(
                f"task.index={index} is out of range: cluster.{task_type} lists "
                f"{listed} address(es)"
            )
        # The chief, when there is one, is process 0; the workers follow it.
        return index if task_type == "chief" else len(lists["chief"]) + index


def _ray_train_context() -> object | None:
    """Ray Train's worker context when this process runs a Ray Train training
    function, else None. Never imports ray: a process that has not imported
    `ray.train` runs no training function of it."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        context = train.get_context()
        context.get_world_size()
    except Exception:  # noqa: BLE001
        # Ray raises RuntimeError outside a training function (the driver, a
        # task, an actor), DeprecationWarning in a Ray Tune function trainable;
        # either way this process is no Ray Train worker.
        return None
    return context


class RayEnvironment(ClusterEnvironment):
    """A worker of a Ray Train worker group started by
    `keras_dist_ray.KerasTrainer` (`integrations/ray`).

    The process count and the rank are the world size and world rank of Ray
    Train's worker context (`ray.train.get_context()`); the coordinator is
    `KERAS_DIST_RAY_COORDINATOR_ADDRESS`, which the trainer's backend sets on
    every worker before the training function runs: the IP of the node of
    the worker of world rank 0 and a port that was free there. A restarted
    worker group (Ray's `FailureConfig`) gets a new address.

    Detected when `ray.train` is imported and this process runs a Ray Train
    training function, either started by `KerasTrainer` (the variable is set)
    or in a group of several workers; keras_dist never imports ray itself. A
    group of several workers started by another trainer is an error naming
    `KerasTrainer`: Ray's `TorchTrainer` and `TensorflowTrainer` form the
    framework's job themselves, which `keras_dist.initialize()` does.
    """

    num_processes_source = "Ray Train's world size"
    process_id_source = "Ray Train's world rank"
    # The rank and size are no variables: Ray Train's context holds them.
    variables = (RAY_COORDINATOR_VARIABLE,)

    @staticmethod
    def detect() -> bool:
        context = _ray_train_context()
        if context is None:
            return False
        if environment_value(RAY_COORDINATOR_VARIABLE) is not None:
            return True
        return context.get_world_size() > 1

    def _context(self) -> object:
        context = _ray_train_context()
        if context is None:
            raise ValueError(
                "RayEnvironment reads Ray Train's worker context, and this "
                "process runs no Ray Train training function. Received: "
                f"{RAY_COORDINATOR_VARIABLE}="
                f"{os.environ.get(RAY_COORDINATOR_VARIABLE)!r}"
            )
        return context

    def coordinator_address(self) -> str:
        address = environment_value(RAY_COORDINATOR_VARIABLE)
        if address is None:
            context = self._context()
            raise ValueError(
                f"This process is worker {context.get_world_rank()} of a Ray "
                f"Train worker group of {context.get_world_size()}, but "
                f"{RAY_COORDINATOR_VARIABLE} is not set: the group was not "
                "started by keras_dist_ray.KerasTrainer, whose backend gives "
                "every worker the coordinator's address. Start the training "
                "function with keras_dist_ray.KerasTrainer(train_fn, "
                "scaling_config=...) instead of Ray's framework trainers "
                "(TorchTrainer forms the torch.distributed job that "
                "keras_dist.initialize() forms), or pass `job_addresses`, "
                "`num_processes` and `process_id` to keras_dist.initialize()."
            )
        try:
            split_address(address)
        except ValueError:
            raise ValueError(
                f"{RAY_COORDINATOR_VARIABLE} must be 'host:port'. Received: "
                f"{RAY_COORDINATOR_VARIABLE}={address!r}"
            ) from None
        return address

    def num_processes(self) -> int:
        return _positive("Ray Train's world size", self._context().get_world_size())

    def process_id(self) -> int:
        context = self._context()
        return _rank_in_range(
            "Ray Train's world rank",
            context.get_world_rank(),
            "Ray Train's world size",
            context.get_world_size(),
        )

    def local_process_id(self) -> int | None:
        return self._context().get_local_rank()


def _require_all(kind: str, names: tuple[str, ...]) -> None:
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
    variables = _JAX_VARIABLES

    @staticmethod
    def detect() -> bool:
        return any(
            environment_value(name) for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        )

    def coordinator_address(self) -> str:
        _require_all("JAX job", _JAX_VARIABLES)
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
        _require_all("JAX job", _JAX_VARIABLES)
        return _positive("JAX_NUM_PROCESSES", environment_int("JAX_NUM_PROCESSES"))

    def process_id(self) -> int:
        _require_all("JAX job", _JAX_VARIABLES)
        return _rank_in_range(
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
    variables = (*_PET_VARIABLES, PET_NPROC_PER_NODE_VARIABLE)

    @staticmethod
    def detect() -> bool:
        return any(environment_value(name) for name in ("PET_NNODES", "PET_NODE_RANK"))

    def _check(self) -> None:
        _require_all("Kubeflow torch runtime (PET_*)", _PET_VARIABLES)
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
        port = _port("PET_MASTER_PORT", environment_value("PET_MASTER_PORT"))
        return join_address(host, port)

    def num_processes(self) -> int:
        self._check()
        return _positive("PET_NNODES", environment_int("PET_NNODES"))

    def process_id(self) -> int:
        self._check()
        return _rank_in_range(
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
        *_JOBSET_VARIABLES,
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
        _require_all("JobSet", _JOBSET_VARIABLES)
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
        return join_address(host, _fixed_coordinator_port())

    def num_processes(self) -> int:
        self._check()
        return _positive(
            "JOBSET_GLOBAL_REPLICAS", environment_int("JOBSET_GLOBAL_REPLICAS")
        )

    def process_id(self) -> int:
        self._check()
        return _rank_in_range(
            "JOBSET_JOB_GLOBAL_INDEX",
            environment_int("JOBSET_JOB_GLOBAL_INDEX"),
            "JOBSET_GLOBAL_REPLICAS",
            self.num_processes(),
        )


#: The environments `detect_cluster` tries, in order.
CLUSTER_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    RayEnvironment,
    TorchrunEnvironment,
    SlurmEnvironment,
    JaxEnvironment,
    KubeflowTorchEnvironment,
    JobSetEnvironment,
    TFConfigEnvironment,
)


def detect_cluster() -> ClusterEnvironment | None:
    """The first environment of `CLUSTER_ENVIRONMENTS` whose variables are set.

    Returns:
        An instance of it, or None when this process was not started by a
        known launcher.

    Example:

    >>> cluster = detect_cluster()  # rank 1 of `torchrun --nproc-per-node 2`
    >>> cluster.coordinator_address(), cluster.num_processes(), cluster.process_id()
    ('127.0.0.1:29500', 2, 1)
    """
    for environment in CLUSTER_ENVIRONMENTS:
        if environment.detect():
            return environment()
    return None


def explain_detection() -> list[dict[str, object]]:
    """What `detect_cluster` sees, for `keras-dist env`: every environment of
    `CLUSTER_ENVIRONMENTS` in the order they are tried, whether its
    `detect()` said yes, and which of the variables it reads are set.

    Returns:
        One dict per environment: `name`, `detected` (bool), `chosen` (the
        first detected one, the one `detect_cluster` returns), `summary`
        (its docstring's first line) and `set` (`{variable: value}`).
    """
    explained: list[dict[str, object]] = []
    chosen = False
    for environment in CLUSTER_ENVIRONMENTS:
        detected = bool(environment.detect())
        variables = getattr(environment, "variables", ())
        explained.append(
            {
                "name": environment.__name__,
                "detected": detected,
                "chosen": detected and not chosen,
                "summary": " ".join(
                    (environment.__doc__ or "").strip().split("\n\n")[0].split()
                ),
                "reads": list(variables),
                "set": {
                    name: os.environ[name]
                    for name in variables
                    if environment_value(name) is not None
                },
            }
        )
        chosen = chosen or detected
    return explained
