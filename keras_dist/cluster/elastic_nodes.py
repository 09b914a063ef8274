"""One node of an elastic multi-node job: join a round at the rendezvous, run
this node's processes for it, and start again when the membership changes.

`Launcher.run` hands over here when its config has `min_nnodes`
(`keras-dist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`); the rules of
the rounds are in `keras_dist.cluster.elastic_rendezvous`. Standard library
only, as the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
from typing import Any

from keras_dist.cluster.addresses import find_free_port, split_address
from keras_dist.cluster.elastic_rendezvous import (
    RendezvousClient,
    RendezvousError,
    RendezvousServer,
)

# `launcher` below is the `keras_dist.cluster.launcher.Launcher` that hands
# over (not imported: that module imports this one).
Launcher = Any

# The exit code of a node that could not take part (no round formed, the
# rendezvous lost), as a launcher's own errors.
_RENDEZVOUS_FAILED = 1


def _serve_if_first(launcher: Launcher) -> RendezvousServer | None:
    """The rendezvous, when this is the first launcher on the endpoint's host
    to bind it; None when another one serves it (or the host is not this
    one)."""
    config = launcher.config
    try:
        return RendezvousServer(
            config.rdzv_endpoint,
            min_nodes=config.min_nnodes,
            max_nodes=config.nnodes,
            max_restarts=config.max_restarts,
            node_timeout=config.node_timeout,
            nproc_per_node=config.nproc_per_node,
        )
    except OSError:
        return None


def run(launcher: Launcher) -> int:
    """The node's whole job; returns its exit code (the processes' code, as
    `Launcher.run`)."""
    config = launcher.config
    server = _serve_if_first(launcher)
    name = f"{socket.gethostname()}:{os.getpid()}"
    client = RendezvousClient(
        config.rdzv_endpoint,
        name,
        timeout=config.rdzv_timeout,
        node_timeout=config.node_timeout,
    )
    try:
        return _rounds(launcher, client)
    except RendezvousError as error:
        launcher._message(f"elastic: {error}; this node ends")
        return _RENDEZVOUS_FAILED
    finally:
        client.close()
        client.leave()  # whatever ended it: no other node waits for this one
        if server is not None:
            # The others learn that the job finished (or this node left)
            # from the next answer; give them the time of a heartbeat or two.
            server.wait_for_nodes_to_hear()
            server.close()


def _rounds(launcher: Launcher, client: RendezvousClient) -> int:
    config = launcher.config
    try:
        host = client.local_host()
    except OSError:
        host, _ = split_address(config.rdzv_endpoint, name="rdzv_endpoint")
    client.start_heartbeat()

    def signalled() -> bool:
        return bool(launcher._stop_signals)

    attempt = 0
    while True:
        answer = client.join(host, find_free_port(host), give_up=signalled)
        if answer["status"] == "stopped":
            client.leave()
            name = signal.Signals(launcher._stop_signals[0]).name
            launcher._message(
                f"received {name} while waiting for a round; this node ends"
            )
            return 128 + launcher._stop_signals[0]
        if answer["status"] == "finished":
            return 0
        if answer["status"] == "leave":
            launcher._message(
                f"elastic: this node leaves the job with no restart left "
                f"({answer['why']})"
            )
            return answer["code"]
        launcher._message(
            f"elastic: round {answer['round']}: {answer['change']}; this node is "
            f"node {answer['node_rank']} of {answer['nnodes']}, "
            f"{answer['nnodes'] * config.nproc_per_node} process(es) in all"
        )
        launcher._attempt_config = dataclasses.replace(
            config,
            nnodes=answer["nnodes"],
            node_rank=answer["node_rank"],
            coordinator=answer["coordinator"],
            min_nnodes=None,
            rdzv_endpoint=None,
            max_restarts=0,
        )
        launcher._external_stop = lambda: _stop_reason(client)
        try:
            exit_code, failure = launcher._run_attempt(attempt)
        finally:
            launcher._external_stop = None
        attempt += 1
        if launcher._stop_signals or launcher._preemption_signals:
            # Stopped or preempted from outside: this node leaves the job
            # with its code (the others go on without it when they can).
            client.leave()
            return exit_code if exit_code is not None else 1
        if failure is None and exit_code == 0:
            client.ended(0, "")
            status = client.wait_finished(give_up=signalled)
            if status == "finished":
                return 0
            if status == "stopped":
                client.leave()
                return 128 + launcher._stop_signals[0]
            continue
        if exit_code is None:
            continue  # stopped for the next round (`_stop_reason`)
        # The first of this node's processes to fail, for the rendezvous to
        # tell which node failed first.
        failed_at = [
            rank.exited_at
            for rank in launcher._ranks
            if rank.exited_at is not None and rank.process.returncode
        ]
        client.ended(
            exit_code, failure or f"exit code {exit_code}", min(failed_at, default=None)
        )


def _stop_reason(client: RendezvousClient) -> str | None:
    """Why this node's processes must stop now, or None: the round ended
    elsewhere (a node failed, was lost or joined), or the rendezvous is gone."""
    status = client.poll()
    if status == "restart":
        return "the job's membership changes: stopping at one agreed step"
    if status == "lost":
        return "the rendezvous does not answer"
    return None
