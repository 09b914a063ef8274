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
   - `SlurmEnvironment`: `SLURM_PROCID`, `SLURM_NTASKS` and the node list of
     an `srun` task;
   - `TFConfigEnvironment`: the `TF_CONFIG` JSON of TensorFlow clusters
     (Kubeflow TFJob, Vertex AI).

Levels 1 and 2 fill the three values one by one, and a value they give wins
over the cluster's even when the two disagree: `KERAS_DISTRIBUTION_NUM_PROCESSES=2`
inside an 8-task SLURM step makes a job of 2 processes, and tasks whose
`SLURM_PROCID` is 2 or more then fail with an error naming both values. The
cluster is only consulted for what levels 1 and 2 leave open.

torchrun comes before SLURM because `srun torchrun ...` sets both, and then
torchrun's `RANK`/`WORLD_SIZE` describe the training processes while the SLURM
variables describe the torchrun launchers. `TF_CONFIG` comes last: it is the
least specific, and stale copies of it are common in notebooks.

Variables that are present but incomplete or inconsistent are an error naming
them and their values, never a silent single-process run.
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import re

DEFAULT_SLURM_COORDINATOR_PORT = 12355
SLURM_COORDINATOR_PORT_VARIABLE = "KERAS_DIST_COORDINATOR_PORT"

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
_TF_CONFIG_TASK_TYPES = ("chief", "worker")

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

    Detected when both `SLURM_PROCID` and `SLURM_NTASKS` are set: an `salloc`
    shell has only the second and an `sbatch` script without `--ntasks` only
    the first, and both are single processes. The coordinator is the first
    host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`) on port
    `KERAS_DIST_COORDINATOR_PORT`, default 12355. The port is fixed because
    every task must compute the same address without talking to the others;
    set `KERAS_DIST_COORDINATOR_PORT` when two jobs share that host or the
    port is taken.

    Run the script under `srun`: a script started directly by an `sbatch`
    script with `--ntasks=4` sees `SLURM_PROCID=0`, `SLURM_NTASKS=4` and waits
    for three processes that never come (until the initialize timeout). Set
    `KERAS_DISTRIBUTION_NUM_PROCESSES=1` to run such a script alone.
    """

    num_processes_source = "SLURM_NTASKS"
    process_id_source = "SLURM_PROCID"

    @staticmethod
    def detect() -> bool:
        return all(environment_value(name) for name in ("SLURM_PROCID", "SLURM_NTASKS"))

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
        raw_port = environment_value(SLURM_COORDINATOR_PORT_VARIABLE)
        port = (
            DEFAULT_SLURM_COORDINATOR_PORT
            if raw_port is None
            else _port(SLURM_COORDINATOR_PORT_VARIABLE, raw_port)
        )
        return join_address(host, port)

    def num_processes(self) -> int:
        return _positive("SLURM_NTASKS", environment_int("SLURM_NTASKS"))

    def process_id(self) -> int:
        return _rank_in_range(
            "SLURM_PROCID",
            environment_int("SLURM_PROCID"),
            "SLURM_NTASKS",
            self.num_processes(),
        )

    def local_process_id(self) -> int | None:
        return environment_int("SLURM_LOCALID")


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


#: The environments `detect_cluster` tries, in order.
CLUSTER_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    TorchrunEnvironment,
    SlurmEnvironment,
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
