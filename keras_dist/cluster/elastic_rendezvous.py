"""The rendezvous of an elastic multi-node job (`keras-dist launch --nnodes
MIN:MAX --rdzv-endpoint HOST:PORT`): which nodes form the job, and when it
starts again.

Every node's launcher runs the same command. The first to bind the endpoint
(on its host) serves the rendezvous (`RendezvousServer`); every launcher, that
one included, is a `RendezvousClient`. A round forms when at least MIN nodes
have joined and either MAX have, or every node alive has, or `node_timeout`
seconds have passed since the MIN-th joined; the nodes get their ranks in the
order they had (new ones after), and the coordinator of the round is a port
node 0 chose. While a round runs every node sends a heartbeat twice a
second; the round ends for all when a node's processes fail or end early, a
node misses heartbeats for `node_timeout` seconds (lost), or a node that is
not a member joins (the job grows back). Each node then stops its processes
(SIGTERM: a `kd.Checkpoint` saves at the step all agree on) and joins the
next round; `fit` resumes from the checkpoint on the new count.

Restarts (`--max-restarts`) count the rounds that failed with every member
still alive; a lost node or a growing job counts none. With them used up, the
node whose processes failed first leaves (it exits with their code) and the
others go on without it, never fewer than MIN nodes. The node serving the
rendezvous must stay: when it is lost the others end, naming it (as with
torchrun's c10d rendezvous).

Standard library only (JSON lines over TCP), as the launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from keras_dist.cluster.addresses import join_address, split_address

__all__ = ["RendezvousClient", "RendezvousError", "RendezvousServer"]

#: How often a node tells the rendezvous it is alive.
HEARTBEAT_SECONDS = 0.5
# How long one request may take (the server answers at once).
_REQUEST_SECONDS = 5.0
# Answers after which a node asks no more: the job finished, or it leaves.
_FINAL = ("finished", "leave")


class RendezvousError(RuntimeError):
    """The rendezvous cannot be reached, or did not form a job in time."""


@dataclasses.dataclass
class _Node:
    name: str
    host: str
    port: int
    seen: float
    joined: float | None = None  # waiting for the next round since
    answered: float = 0.0  # when its last answer was written back
    left: bool = False


class RendezvousServer:
    """The rendezvous state and the TCP server that answers the nodes.

    Args:
        endpoint: `"host:port"` to listen on.
        min_nodes, max_nodes: the job's node count range.
        max_restarts: rounds that may fail with every member alive.
        nproc_per_node: each node's processes (the same on every node: the
            same command), for the ranks the membership lines name.
        node_timeout: seconds without a heartbeat after which a node is lost;
            also how long a round waits for more nodes once MIN joined (so
            that a node lost just before is known lost when the round forms).

    Raises:
        OSError: when the endpoint cannot be bound (another node serves it).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        min_nodes: int,
        max_nodes: int,
        max_restarts: int,
        node_timeout: float,
        nproc_per_node: int = 1,
    ) -> None:
        host, port = split_address(endpoint, name="rdzv_endpoint")
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.max_restarts = max_restarts
        self.nproc_per_node = nproc_per_node
        self.node_timeout = self.last_call = node_timeout
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._round = -1
        self._members: list[str] = []
        self._coordinator = ""
        self._change = ""
        self._running = False
        self._ended: dict[str, tuple[float, int, str]] = {}  # node: (at, code, why)
        self._succeeded: set[str] = set()
        self._finished = False
        self._restarts = 0
        self._leaving: dict[str, tuple[int, str]] = {}
        self._min_reached: float | None = None
        self._accounted = -1  # the last round whose failure was counted
        rendezvous = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline()
                if not line.strip():
                    return  # a node finding its own address (`local_host`)
                request = json.loads(line)
                answer = rendezvous._answer(request)
                self.wfile.write((json.dumps(answer) + "\n").encode())
                self.wfile.flush()
                rendezvous._answered(request["node"])

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(socketserver.ThreadingTCPServer):
            address_family = family
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name="keras-dist-rendezvous",
            daemon=True,
        )
        self._thread.start()

    def wait_for_nodes_to_hear(self) -> None:
        """Before the serving node ends: give every other node alive the time
        to ask once more and get its answer back (that the job finished, or
        that it goes on without this node), at most `node_timeout` seconds."""
        start = time.monotonic()
        while time.monotonic() - start < self.node_timeout:
            with self._lock:
                now = time.monotonic()
                if all(
                    node.answered > start or not self._alive(node, now)
                    for node in self._nodes.values()
                ):
                    return
            time.sleep(0.05)

    def _answered(self, name: str) -> None:
        with self._lock:
            if name in self._nodes:
                self._nodes[name].answered = time.monotonic()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the state ---------------------------------------------------------------
    def _alive(self, node: _Node, now: float) -> bool:
        return not node.left and now - node.seen < self.node_timeout

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            name = request["node"]
            node = self._nodes.get(name)
            if node is None:
                node = self._nodes[name] = _Node(name, request.get("host", ""), 0, now)
            node.seen = now
            kind = request["kind"]
            if kind == "join":
                node.host, node.port = request["host"], request["port"]
                node.joined = now
            elif kind == "ended":
                if request["round"] == self._round and name in self._members:
                    if request["code"] == 0:
                        self._succeeded.add(name)
                    else:
                        self._ended.setdefault(
                            name, (request["at"], request["code"], request["why"])
                        )
            elif kind == "leave":
                node.left = True
            self._update(now)
            return self._status(name, request.get("round"), now)

    def _update(self, now: float) -> None:
        members = [self._nodes[m] for m in self._members]
        if self._running:
            if self._members and all(m in self._succeeded for m in self._members):
                self._finished = True
                self._running = False
                return
            lost = [m for m in members if not self._alive(m, now)]
            waiting = [
                n
                for n in self._nodes.values()
                if n.joined is not None and n.name not in self._members
            ]
            if self._ended or lost or (waiting and len(members) < self.max_nodes):
                self._running = False
            return
        if self._finished:
            return
        joined = [n for n in self._nodes.values() if n.joined is not None]
        if len(joined) < self.min_nodes:
            self._min_reached = None
            return
        if self._min_reached is None:
            self._min_reached = now
        alive = [n for n in self._nodes.values() if self._alive(n, now)]
        # A member of the last round still alive is stopping its processes
        # (a save at the agreed step can take a while): it is waited for. The
        # first round waits the last call for nodes still starting; a later
        # one forms as soon as every node alive is back.
        stopping = any(n.joined is None and n.name in self._members for n in alive)
        if not (
            len(joined) >= self.max_nodes
            or (
                not stopping
                and (
                    (self._round >= 0 and all(n.joined is not None for n in alive))
                    or now - self._min_reached >= self.last_call
                )
            )
        ):
            return
        self._form(joined, now)

    def _form(self, joined: list[_Node], now: float) -> None:
        previous = list(self._members)
        lost = [m for m in previous if not self._alive(self._nodes[m], now)]
        leaving = None
        if self._ended and not lost and self._accounted != self._round:
            # Every member was alive: the round failed on its own.
            self._accounted = self._round
            self._restarts += 1
            if self._restarts > self.max_restarts:
                first = min(self._ended, key=lambda m: self._ended[m][0])
                _, code, why = self._ended[first]
                leaving = first
                self._leaving[first] = (code, why)
                self._nodes[first].joined = None
                self._nodes[first].left = True
        joined = [n for n in joined if n.name != leaving]
        if len(joined) < self.min_nodes:
            return
        order = {name: index for index, name in enumerate(previous)}
        joined.sort(key=lambda n: (order.get(n.name, len(order)), n.joined))
        joined = joined[: self.max_nodes]
        self._members = [n.name for n in joined]
        for node in joined:
            node.joined = None
        self._round += 1
        self._coordinator = join_address(joined[0].host, joined[0].port)
        self._running = True
        self._ended = {}
        self._succeeded = set()
        self._min_reached = None
        self._change = _describe_change(
            previous,
            self._members,
            lost,
            leaving,
            self._leaving,
            self.min_nodes,
            self.max_nodes,
            self.nproc_per_node,
        )

    def _status(self, name: str, round_number: int | None, now: float) -> dict:
        if name in self._leaving:
            code, why = self._leaving[name]
            return {"status": "leave", "code": code, "why": why}
        if self._finished:
            return {"status": "finished"}  # members, and a spare node waiting
        if self._running and name in self._members:
            if round_number is None or round_number < self._round:
                return {
                    "status": "ready",
                    "round": self._round,
                    "node_rank": self._members.index(name),
                    "nnodes": len(self._members),
                    "coordinator": self._coordinator,
                    "change": self._change,
                }
            return {"status": "running"}
        if round_number is not None and round_number == self._round:
            return {"status": "restart"}  # the round this node ran has ended
        return {"status": "waiting"}


def _describe_change(
    previous: list[str],
    members: list[str],
    lost: list[str],
    leaving: str | None,
    leaving_why: dict[str, tuple[int, str]],
    min_nodes: int,
    max_nodes: int,
    nproc: int,
) -> str:
    size = f"{len(members)} node(s) (at least {min_nodes}, at most {max_nodes})"
    if not previous:
        return f"the job starts on {size}"

    def node(order: list[str], name: str) -> str:
        first = order.index(name) * nproc
        ranks = f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"
        return f"node {order.index(name)} ({name}, {ranks})"

    parts = []
    if lost:
        parts.append(
            "lost " + ", ".join(node(previous, m) for m in lost) + " (no heartbeat)"
        )
    if leaving is not None:
        parts.append(
            f"{node(previous, leaving)} left with no restart left "
            f"({leaving_why[leaving][1]})"
        )
    new = [m for m in members if m not in previous]
    if new:
        parts.append("joined: " + ", ".join(node(members, m) for m in new))
    if not parts:
        return f"the same {size} start again"
    return "; ".join(parts) + f": going on with {size}"


class RendezvousClient:
    """What one node's launcher asks the rendezvous, and its heartbeat.

    Args:
        endpoint: the rendezvous' `"host:port"`.
        name: this node's name in the job (unique: host and launcher pid).
        timeout: seconds to wait for the rendezvous to answer at all, and for
            a round to form.
        node_timeout: seconds after which an unreachable rendezvous counts as
            lost.
    """

    def __init__(
        self, endpoint: str, name: str, *, timeout: float, node_timeout: float
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.timeout = timeout
        self.node_timeout = node_timeout
        self.round: int | None = None
        self._last_answer = time.monotonic()
        self._state: dict[str, Any] = {"status": "waiting"}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None

    def _ask(self, kind: str, **fields: Any) -> dict[str, Any]:
        host, port = split_address(self.endpoint, name="rdzv_endpoint")
        request = {"kind": kind, "node": self.name, "round": self.round, **fields}
        with socket.create_connection((host, port), _REQUEST_SECONDS) as connection:
            connection.sendall((json.dumps(request) + "\n").encode())
            answer = connection.makefile().readline()
        if not answer:
            raise OSError("the rendezvous closed the connection")
        self._last_answer = time.monotonic()
        return json.loads(answer)

    def local_host(self) -> str:
        """This node's address as the rendezvous' host sees it (the interface
        that reaches the endpoint)."""
        host, port = split_address(self.endpoint, name="rdzv_endpoint")
        with socket.create_connection((host, port), _REQUEST_SECONDS) as connection:
            return connection.getsockname()[0]

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_SECONDS):
                sent_for = self.round
                with contextlib.suppress(OSError, ValueError):
                    answer = self._ask("heartbeat", round=sent_for)
                    with self._lock:
                        # An answer about a round this node has left behind
                        # (it joined the next one meanwhile) is stale.
                        if self.round == sent_for:
                            self._state = answer

        self._heartbeat = threading.Thread(
            target=beat, name="keras-dist-rendezvous-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(_REQUEST_SECONDS)

    def join(
        self, host: str, port: int, give_up: Callable[[], bool] = lambda: False
    ) -> dict[str, Any]:
        """Join the next round and wait for it to form; returns the answer:
        `ready` (the round: `node_rank`, `nnodes`, `coordinator`, `change`),
        `finished`, `leave`, or `stopped` once `give_up()` is true (the
        launcher was signalled).

        Raises:
            RendezvousError: when no round formed within `timeout`, or the
                rendezvous was unreachable for `node_timeout` seconds.
        """
        deadline = time.monotonic() + self.timeout
        answer = self._retrying("join", host=host, port=port)
        while answer["status"] == "waiting" or (
            answer["status"] in ("running", "restart")
        ):
            if give_up():
                return {"status": "stopped"}
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"no round of the elastic job formed in {self.timeout:g} s "
                    f"(rendezvous {self.endpoint}): fewer nodes than --nnodes' "
                    "minimum joined"
                )
            time.sleep(0.1)
            answer = self._retrying("wait")
        with self._lock:
            if answer["status"] == "ready":
                self.round = answer["round"]
            self._state = answer
        return answer

    def _retrying(self, kind: str, **fields: Any) -> dict[str, Any]:
        while True:
            try:
                return self._ask(kind, **fields)
            except (OSError, ValueError) as error:
                with self._lock:
                    heard = self._state
                if heard.get("status") in _FINAL:
                    # The heartbeat already heard the end (the serving node
                    # may close once this node was answered, by either
                    # thread): the answer stands.
                    return heard
                if time.monotonic() - self._last_answer > self.node_timeout:
                    raise RendezvousError(
                        f"the rendezvous at {self.endpoint} did not answer for "
                        f"{self.node_timeout:g} s ({error}): the node serving it "
                        "(the first launcher on that host) is gone"
                    ) from error
                time.sleep(0.1)

    def ended(self, code: int, why: str, at: float | None = None) -> None:
        """Say this node's processes of the current round ended (`at`: when
        the first of them failed, wall-clock; now when None)."""
        at = time.time() if at is None else at
        self._state = self._retrying("ended", code=code, why=why, at=at)

    def leave(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._ask("leave")

    def poll(self) -> str:
        """The current round's state from the last heartbeat: `running`,
        `restart`, `finished`, `leave`; `lost` when the rendezvous has not
        answered for `node_timeout` seconds."""
        if time.monotonic() - self._last_answer > self.node_timeout:
            return "lost"
        return self._state.get("status", "running")

    def wait_finished(self, give_up: Callable[[], bool] = lambda: False) -> str:
        """After this node's processes succeeded: wait until every member's
        did (`finished`) or the round ended elsewhere (`restart`/`leave`);
        `stopped` once `give_up()` is true."""
        while not give_up():
            status = self._retrying("wait").get("status")
            if status not in ("running",):
                return status
            time.sleep(0.1)
        return "stopped"
