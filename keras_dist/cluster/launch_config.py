"""What `keras-dist launch` starts (`LaunchConfig`), checked when it is made.

Standard library only, as the launcher (`keras_dist.cluster.launcher`).
"""

from __future__ import annotations

import dataclasses
import math
import os

from keras_dist.cluster.addresses import split_address

DEFAULT_GRACE_PERIOD_SECONDS = 10.0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int. Received: {name}={value!r}")
    if value < minimum:
        raise ValueError(
            f"`{name}` must be at least {minimum}. Received: {name}={value}"
        )


def _check_hang_timeout(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            "`hang_timeout` must be a number of seconds (0 turns the hang doctor "
            f"off). Received: hang_timeout={value!r}"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            "`hang_timeout` must be a finite number of seconds >= 0 (0 turns the "
            f"hang doctor off). Received: hang_timeout={value!r}"
        )


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What `launch` starts: `nproc_per_node` copies of a script on this node.

    Args:
        script: path of the Python script each process runs.
        script_args: arguments passed to every copy of the script.
        nproc_per_node: processes started on this node.
        nnodes: nodes in the job; each runs the same command.
        node_rank: this node's index, `0 <= node_rank < nnodes`.
        coordinator: `"host:port"` of process 0's node. Required when
            `nnodes > 1`; on one node, defaults to 127.0.0.1 with a free port.
        max_restarts: how often the whole group is restarted after a failure.
        min_nproc: elastic: with its restarts used up, a job that loses a
            process goes on with the ones left instead of failing, started
            again with one process fewer each time (never fewer than
            `min_nproc`); `fit` resumes from its `kd.Checkpoint` on the new
            count, with the same global batch. None (the default) is
            `nproc_per_node`: the job ends when a process fails. One node only
            for now.
        grace_period_seconds: how long stopped processes get between SIGTERM
            and SIGKILL.
        hang_timeout: seconds a rank may go without progress inside a
            keras_dist `fit`/`evaluate`/`predict` before every rank dumps its
            stacks, one summary names the rank(s) behind and the job ends with
            code 124; 0 turns the hang doctor off. Passed to the ranks as
            `KERAS_DIST_HANG_TIMEOUT`; None leaves that variable as it is
            (unset: 1800 s). See `keras_dist.faults.heartbeat`.

    Example:

    >>> config = LaunchConfig("train.py", ("--epochs", "3"), nproc_per_node=2)
    """

    script: str
    script_args: tuple[str, ...] = ()
    _: dataclasses.KW_ONLY
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    max_restarts: int = 0
    grace_period_seconds: float = DEFAULT_GRACE_PERIOD_SECONDS
    hang_timeout: float | None = None
    min_nproc: int | None = None

    def __post_init__(self) -> None:
        _check_int("nproc_per_node", self.nproc_per_node, 1)
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        _check_int("max_restarts", self.max_restarts, 0)
        if self.min_nproc is not None:
            _check_int("min_nproc", self.min_nproc, 1)
            if self.min_nproc > self.nproc_per_node:
                raise ValueError(
                    "`min_nproc` must be at most `nproc_per_node` "
                    f"({self.nproc_per_node}): it is the fewest processes the "
                    f"job may go on with. Received: min_nproc={self.min_nproc}"
                )
            if self.nnodes > 1 and self.min_nproc < self.nproc_per_node:
                raise NotImplementedError(
                    "An elastic job (`min_nproc` below `nproc_per_node`) runs on "
                    "one node for now; the multi-node form is not supported yet. "
                    f"Received: min_nproc={self.min_nproc}, nnodes={self.nnodes}"
                )
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"`node_rank` must be in [0, {self.nnodes - 1}] for a job of "
                f"{self.nnodes} node(s). Received: node_rank={self.node_rank}"
            )
        if self.coordinator is not None:
            split_address(self.coordinator, name="coordinator")
        elif self.nnodes > 1:
            raise ValueError(
                f"A job of {self.nnodes} nodes needs the coordinator's 'host:port' "
                "(an address of the node with node_rank 0 that every node can "
                "reach), passed as --coordinator. Received: coordinator=None"
            )
        if not self.grace_period_seconds > 0:
            raise ValueError(
                "`grace_period_seconds` must be positive. Received: "
                f"grace_period_seconds={self.grace_period_seconds!r}"
            )
        if self.hang_timeout is not None:
            _check_hang_timeout(self.hang_timeout)
        if not os.path.isfile(self.script):
            raise ValueError(
                f"The script to launch does not exist. Received: script={self.script!r}"
            )
        if isinstance(self.script_args, str) or not all(
            isinstance(argument, str) for argument in self.script_args
        ):
            raise TypeError(
                "`script_args` must be a sequence of strings. Received: "
                f"script_args={self.script_args!r}"
            )
        # A list would make the frozen config mutable from outside.
        object.__setattr__(self, "script_args", tuple(self.script_args))

    @property
    def world_size(self) -> int:
        """Processes in the whole job, over all nodes."""
        return self.nproc_per_node * self.nnodes

    @property
    def elastic(self) -> bool:
        """Whether the job goes on with fewer processes after a loss."""
        return self.min_nproc is not None and self.min_nproc < self.nproc_per_node
