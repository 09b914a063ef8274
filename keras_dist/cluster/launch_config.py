"""What `keras-dist launch` starts (`LaunchConfig`), checked when it is made.

Standard library only, as the launcher (`keras_dist.cluster.launcher`).
"""

from __future__ import annotations

import dataclasses
import math
import os

from keras_dist.cluster.addresses import split_address

DEFAULT_GRACE_PERIOD_SECONDS = 10.0
#: Elastic multi-node jobs: seconds without a heartbeat before a node is lost.
DEFAULT_NODE_TIMEOUT_SECONDS = 10.0
#: Elastic multi-node jobs: seconds a node waits for a round to form.
DEFAULT_RDZV_TIMEOUT_SECONDS = 600.0


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
        nnodes: nodes in the job; each runs the same command. With
            `min_nnodes`, the most nodes the job grows to.
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
            (for several, see `min_nnodes`).
        min_nnodes: elastic on several nodes (`--nnodes MIN:MAX`): the fewest
            nodes the job runs on. The nodes meet at `rdzv_endpoint`, which
            gives them their ranks; when a node is lost (no heartbeat for
            `node_timeout` seconds) or leaves with its restarts used up, the
            others stop at one agreed step and start again without it; a node
            that starts later joins at the next such point (the job grows
            back). See `keras_dist.cluster.elastic_rendezvous`. None: a fixed
            job of `nnodes` nodes.
        rdzv_endpoint: `"host:port"` of the rendezvous (elastic multi-node):
            the first launcher on that host serves it, and must stay.
        node_timeout: elastic multi-node: seconds without a heartbeat before a
            node counts as lost; also how long a new round waits for more
            nodes once `min_nnodes` joined.
        rdzv_timeout: elastic multi-node: seconds a node waits for a round
            of at least `min_nnodes` nodes to form before it gives up.
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
    min_nnodes: int | None = None
    rdzv_endpoint: str | None = None
    node_timeout: float = DEFAULT_NODE_TIMEOUT_SECONDS
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT_SECONDS

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
            if (
                self.nnodes > 1
                and self.min_nnodes is None
                and self.min_nproc < self.nproc_per_node
            ):
                raise NotImplementedError(
                    "`min_nproc` below `nproc_per_node` (losing processes of a "
                    "node) is for one node; a job of several nodes is elastic "
                    "by whole nodes: --nnodes MIN:MAX with --rdzv-endpoint. "
                    f"Received: min_nproc={self.min_nproc}, nnodes={self.nnodes}"
                )
        if self.min_nnodes is not None or self.rdzv_endpoint is not None:
            self._check_elastic_nodes()
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"`node_rank` must be in [0, {self.nnodes - 1}] for a job of "
                f"{self.nnodes} node(s). Received: node_rank={self.node_rank}"
            )
        if self.coordinator is not None:
            split_address(self.coordinator, name="coordinator")
        elif self.nnodes > 1 and self.min_nnodes is None:
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

    def _check_elastic_nodes(self) -> None:
        if self.min_nnodes is None or self.rdzv_endpoint is None:
            raise ValueError(
                "An elastic multi-node job needs both `min_nnodes` (the fewest "
                "nodes) and `rdzv_endpoint` (the rendezvous' HOST:PORT). "
                f"Received: min_nnodes={self.min_nnodes!r}, "
                f"rdzv_endpoint={self.rdzv_endpoint!r}"
            )
        _check_int("min_nnodes", self.min_nnodes, 1)
        if self.min_nnodes > self.nnodes:
            raise ValueError(
                f"`min_nnodes` must be at most `nnodes` ({self.nnodes}). "
                f"Received: min_nnodes={self.min_nnodes}"
            )
        split_address(self.rdzv_endpoint, name="rdzv_endpoint")
        if self.coordinator is not None or self.node_rank != 0:
            raise ValueError(
                "An elastic multi-node job gets each node's rank and the "
                "coordinator from its rendezvous: leave out `node_rank` and "
                f"`coordinator`. Received: node_rank={self.node_rank}, "
                f"coordinator={self.coordinator!r}"
            )
        if self.min_nproc is not None and self.min_nproc < self.nproc_per_node:
            raise NotImplementedError(
                "An elastic multi-node job loses and regains whole nodes; "
                "`min_nproc` (one node's processes) cannot be combined with it "
                f"yet. Received: min_nproc={self.min_nproc}, "
                f"min_nnodes={self.min_nnodes}"
            )
        for name in ("node_timeout", "rdzv_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"`{name}` must be a number of seconds. Received: {name}={value!r}"
                )
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"`{name}` must be a positive number of seconds. Received: "
                    f"{name}={value!r}"
                )

    @property
    def world_size(self) -> int:
        """Processes in the whole job, over all nodes."""
        return self.nproc_per_node * self.nnodes

    @property
    def elastic(self) -> bool:
        """Whether the job goes on with fewer processes after a loss (one
        node: `min_nproc`)."""
        return self.min_nproc is not None and self.min_nproc < self.nproc_per_node

    @property
    def elastic_nodes(self) -> bool:
        """Whether nodes meet at a rendezvous (`min_nnodes`)."""
        return self.min_nnodes is not None
