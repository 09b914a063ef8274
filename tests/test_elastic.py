"""Elastic jobs on one node: `keras-dist launch --min-nproc M` goes on with the
processes left when one is lost and its restarts are used up; `fit` resumes
from its `kd.Checkpoint` on the new count, with the same global batch, and
ends as an uninterrupted run.

Real processes on loopback (PyTorch, gloo: the launcher and the resume on
another count are the same code on every backend, and each backend's resume
on another count runs in test_checkpoint_jobs.py / test_checkpoint_jax.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from keras_dist.checkpoint import store
from keras_dist.cluster.addresses import find_free_port
from keras_dist.cluster.launcher import LaunchConfig
from tests.multiprocess import WORKERS
from tests.workers.checkpoint_resume_worker import EPOCHS, fit_in_this_process

BACKEND = keras.backend.backend()
WORKER = WORKERS / "checkpoint_resume_worker.py"


def _launch(tmp_path, *flags: str, faults: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(
        KERAS_BACKEND=BACKEND,
        DROPOUT="0",
        FAULTS=faults,
        TIMES_DIR=str(tmp_path),
        KERAS_DIST_INIT_TIMEOUT="60",
    )
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        *flags,
        str(WORKER),
        str(tmp_path / "ck"),
        str(tmp_path),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)


def _assert_epoch_logs(directory, history) -> None:
    """The job's per-epoch logs (`epochs.jsonl`, the last attempt's line of
    each epoch wins) equal the uninterrupted run's history within 1e-5."""
    logged = {}
    for line in (directory / "epochs.jsonl").read_text().splitlines():
        entry = json.loads(line)
        logged[entry.pop("epoch")] = entry
    assert sorted(logged) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        expected = {name: values[epoch] for name, values in history.history.items()}
        assert logged[epoch] == pytest.approx(expected, abs=1e-5), epoch


@pytest.mark.backend("torch")
def test_a_rank_lost_with_no_restart_left_the_job_goes_on_with_the_others(
    tmp_path,
):
    """3 processes, --min-nproc 2, no restart: rank 2 is SIGKILLed after step 9
    (mid-epoch 2 of 3); the job goes on with 2 processes from the last
    checkpoint and ends with the uninterrupted run's weights and logs."""
    launched = _launch(
        tmp_path, "--nproc-per-node", "3", "--min-nproc", "2", faults="KILL@9@2"
    )
    log = launched.stderr
    said = [line for line in log.splitlines() if line.startswith("keras-dist")]
    context = "\n".join(said[-30:]) + "\n" + log[-3000:]
    assert launched.returncode == 0, context
    assert "rank 2 was killed by signal SIGKILL" in log, context
    # One line names the lost rank and the new count.
    changes = [line for line in said if "elastic:" in line]
    assert len(changes) == 1, context
    # kd.Checkpoint names the change where it resumes.
    assert "saved by 3 process(es), resuming on 2" in log, context
    assert (
        "rank 2 lost" in changes[0]
        and "going on with 2 process(es) of 3" in (changes[0])
    ), changes[0]
    result = json.loads((tmp_path / "result-0.json").read_text())
    model, history = fit_in_this_process(tmp_path / "reference")
    weights = model.get_weights()
    for ours, theirs in zip(result["weights"], weights, strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=0)
    _assert_epoch_logs(tmp_path, history)
    # The second attempt ran on 2 processes and resumed (not from scratch).
    manifests = sorted((tmp_path / "ck").glob(f"step-*/{store.MANIFEST}"))
    last = json.loads(manifests[-1].read_text())
    assert last["world"]["processes"] == 2
    fault = float((tmp_path / "fault-0.time").read_text())
    back = float((tmp_path / "first-step-1.time").read_text())
    print(f"elastic 3 -> 2: {back - fault:.1f} s from the SIGKILL to training again")
    assert back > fault


LOSES_A_RANK_EACH_ATTEMPT = """
import os, signal, time
attempt = int(os.environ["KERAS_DIST_RESTART_COUNT"])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(os.environ["OUT"], f"{attempt}-{rank}-of-{size}"), "w"):
    pass
if rank == size - 1:
    os.kill(os.getpid(), signal.SIGKILL)  # the last rank is lost each attempt
time.sleep(60)
"""


@pytest.mark.backend_neutral  # the launcher alone (standard library)
def test_a_loss_that_would_go_below_the_minimum_ends_the_job(tmp_path):
    """3 processes, --min-nproc 2: the first loss goes on with 2, the second
    would leave 1, so the job ends with the lost rank's code, saying why."""
    script = tmp_path / "loses.py"
    script.write_text(LOSES_A_RANK_EACH_ATTEMPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env["OUT"] = str(tmp_path)
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist",
            "launch",
            "--nproc-per-node",
            "3",
            "--min-nproc",
            "2",
            "--grace-period",
            "2",
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = launched.stderr
    assert launched.returncode == 128 + 9, log[-3000:]
    started = sorted(path.name for path in tmp_path.iterdir() if "-of-" in path.name)
    assert started == [
        "0-0-of-3",
        "0-1-of-3",
        "0-2-of-3",
        "1-0-of-2",
        "1-1-of-2",
    ], started
    changes = [line for line in log.splitlines() if "elastic:" in line]
    assert len(changes) == 2, log[-3000:]
    assert "rank 2 lost" in changes[0]
    assert "going on with 2 process(es) of 3" in changes[0]
    assert (
        "rank 1 lost with no restart left, and 1 process(es) would be fewer "
        in (changes[1])
        and "--min-nproc 2: the job ends" in changes[1]
    ), changes[1]


@pytest.mark.backend_neutral
def test_min_nproc_is_checked_when_the_launch_is_configured(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match="min_nproc"):
        LaunchConfig(str(script), nproc_per_node=2, min_nproc=3)
    with pytest.raises(ValueError, match="min_nproc"):
        LaunchConfig(str(script), nproc_per_node=2, min_nproc=0)
    with pytest.raises(NotImplementedError, match="one node"):
        LaunchConfig(
            str(script),
            nproc_per_node=2,
            nnodes=2,
            coordinator="127.0.0.1:1234",
            min_nproc=1,
        )
    assert LaunchConfig(str(script), nproc_per_node=3, min_nproc=2).elastic
    assert not LaunchConfig(str(script), nproc_per_node=2, min_nproc=2).elastic


def _nodes_command(nnodes: str, *flags: str) -> list[str]:
    """`keras-dist launch` of one node of an elastic multi-node job: one
    process, `--nnodes nnodes`, a rendezvous on a free loopback port."""
    endpoint = f"127.0.0.1:{find_free_port()}"
    launch = [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "1"]
    return [*launch, "--nnodes", nnodes, "--rdzv-endpoint", endpoint, *flags]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # "pid (name) state ppid ...": the name may hold spaces.
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _wait_for(path, what: str, processes: list, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        for process in processes:
            assert process.poll() is None, f"{what}: a node ended with {process.poll()}"
        assert time.monotonic() < deadline, f"{what}: no {path.name} in {seconds} s"
        time.sleep(0.05)


# On JAX: there `fit`'s resume on another process count (2 -> 1 -> 2) runs
# nowhere else (PyTorch's and TensorFlow's: test_checkpoint_jobs.py; the
# elastic launcher on PyTorch: the test above). The launcher and its rendezvous
# are the same code on every backend (the rendezvous alone: the tests below),
# and each backend's ranks stop at the agreed step on SIGTERM
# (test_fault_lifecycle.py). It passed on PyTorch and TensorFlow when written.
@pytest.mark.backend("jax")
def test_two_nodes_one_lost_the_other_goes_on_and_the_job_grows_back(tmp_path):
    """`--nnodes 1:2`, two nodes of one process each on this machine, meeting
    at a rendezvous on a free port. After step 5 node 1 is lost (its launcher
    and its process SIGKILLed): node 0 goes on alone from the last checkpoint
    (step 4); after step 11 node 1 is started again, joins, and node 0's
    process stops at one agreed step (SIGTERM: kd.Checkpoint saves there);
    the job ends on 2 processes with the uninterrupted run's weights and
    per-epoch logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(
        KERAS_BACKEND=BACKEND,
        DROPOUT="0",
        BACKGROUND="0",
        PAUSE_AT="2@5,1@11",
        TIMES_DIR=str(tmp_path),
        KERAS_DIST_INIT_TIMEOUT="60",
    )
    command = _nodes_command(
        "1:2",
        *("--node-timeout", "3", "--grace-period", "5"),
        *(str(WORKER), str(tmp_path / "ck"), str(tmp_path)),
    )

    def start(name: str) -> subprocess.Popen:
        with (
            (tmp_path / f"{name}.out").open("w") as out,
            (tmp_path / f"{name}.err").open("w") as err,
        ):
            return subprocess.Popen(command, env=env, stdout=out, stderr=err)

    first = start("node-a")
    time.sleep(0.5)  # node A serves the rendezvous
    second = start("node-b")
    nodes = [first, second]
    try:
        _wait_for(tmp_path / "paused-2", "2 nodes at step 5", nodes)
        lost = time.time()
        for pid in [second.pid, *_children(second.pid)]:
            os.kill(pid, signal.SIGKILL)
        second.wait(10)
        _wait_for(tmp_path / "paused-1", "node A alone at step 11", [first])
        again = start("node-c")
        returned = time.time()
        nodes = [first, again]
        codes = [node.wait(240) for node in nodes]
    finally:
        for node in [first, second, *nodes]:
            if node.poll() is None:
                node.kill()
    log = (tmp_path / "node-a.err").read_text()
    context = (
        log[-4000:]
        + "\n--- node C ---\n"
        + (tmp_path / "node-c.err").read_text()[-2000:]
    )
    assert codes == [0, 0], context
    changes = [line for line in log.splitlines() if "elastic: round" in line]
    assert len(changes) == 3, context
    assert "the job starts on 2 node(s)" in changes[0], changes
    assert "lost node 1 (" in changes[1] and ", rank 1) (no heartbeat)" in changes[1]
    assert "going on with 1 node(s)" in changes[1], changes
    assert "joined" in changes[2] and "going on with 2 node(s)" in changes[2]
    assert "saved by 2 process(es), resuming on 1" in log, context
    assert "saved by 1 process(es), resuming on 2" in log, context
    model, history = fit_in_this_process(tmp_path / "reference")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        for ours, theirs in zip(result["weights"], model.get_weights(), strict=True):
            np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=0)
    _assert_epoch_logs(tmp_path, history)
    back = float((tmp_path / "first-step-1.time").read_text())
    grown = float((tmp_path / "first-step-2.time").read_text())
    print(
        f"elastic 2 nodes -> 1: {back - lost:.1f} s from the SIGKILL to training "
        f"again; 1 -> 2: {grown - returned:.1f} s from the node's start to "
        "training on 2"
    )


FAILS_ON_TWO_NODES = """
import os, sys, time
size = int(os.environ["WORLD_SIZE"])
print(f"rank {os.environ['RANK']} of {size}", flush=True)
if size == 2 and os.environ.get("FAIL"):
    time.sleep(0.5)
    sys.exit(3)  # this node's process fails whenever the job has 2 nodes
time.sleep(5 if size == 2 else 0.5)
"""


@pytest.mark.backend_neutral  # the launcher and its rendezvous alone
def test_a_node_whose_process_fails_with_no_restart_left_leaves_the_others_go_on(
    tmp_path,
):
    """`--nnodes 1:2 --max-restarts 0`: node B's process exits 3 while the job
    has 2 nodes, with every node alive. No restart is left, so B leaves with
    its code, saying so, and A goes on alone and ends with 0."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_TWO_NODES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    command = _nodes_command(
        "1:2", "--node-timeout", "2", "--grace-period", "2", str(script)
    )
    first = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    second = subprocess.Popen(
        command, env={**env, "FAIL": "1"}, stderr=subprocess.PIPE, text=True
    )
    try:
        _, first_log = first.communicate(timeout=120)
        _, second_log = second.communicate(timeout=120)
    finally:
        for node in (first, second):
            if node.poll() is None:
                node.kill()
    context = f"{first_log}\n--- node B ---\n{second_log}"
    assert second.returncode == 3, context
    assert "this node leaves the job with no restart left" in second_log, context
    assert "rank 1 exited with code 3" in second_log, context
    assert first.returncode == 0, context
    rounds = [line for line in first_log.splitlines() if "elastic: round" in line]
    assert len(rounds) == 2, context
    assert "left with no restart left" in rounds[1], rounds
    assert "going on with 1 node(s)" in rounds[1], rounds


@pytest.mark.backend_neutral  # the rendezvous alone, in this process
def test_rendezvous_rounds_keep_the_order_grow_back_and_name_a_lost_server():
    """Two nodes of at most 3 form a round after the last call (the first
    round waits it), keeping their join order; a third joining makes the
    running round restart and the next one holds all three in the old order;
    once the server is gone a node's join names it."""
    from keras_dist.cluster.elastic_rendezvous import (  # noqa: PLC0415
        RendezvousClient,
        RendezvousError,
        RendezvousServer,
    )

    endpoint = f"127.0.0.1:{find_free_port()}"
    server = RendezvousServer(
        endpoint, min_nodes=2, max_nodes=3, max_restarts=0, node_timeout=1.0
    )
    clients = [
        RendezvousClient(endpoint, name, timeout=20, node_timeout=1.0)
        for name in ("a", "b", "c")
    ]
    answers: dict = {}

    def join(client) -> None:
        answers[client.name] = client.join("127.0.0.1", find_free_port())

    try:
        started = time.monotonic()
        threads = [threading.Thread(target=join, args=(c,)) for c in clients[:2]]
        for thread in threads:
            thread.start()
            time.sleep(0.1)  # a joins first
        for thread in threads:
            thread.join(20)
        assert time.monotonic() - started >= 1.0, "the first round waits its last call"
        assert [answers[n]["node_rank"] for n in "ab"] == [0, 1], answers
        assert answers["a"]["coordinator"] == answers["b"]["coordinator"]
        assert answers["a"]["change"] == (
            "the job starts on 2 node(s) (at least 2, at most 3)"
        )
        for client in clients[:2]:
            client.start_heartbeat()
        late = threading.Thread(target=join, args=(clients[2],))
        late.start()
        deadline = time.monotonic() + 10
        while not all(c.poll() == "restart" for c in clients[:2]):
            assert time.monotonic() < deadline, [c.poll() for c in clients[:2]]
            time.sleep(0.05)
        threads = [threading.Thread(target=join, args=(c,)) for c in clients[:2]]
        for thread in [*threads]:
            thread.start()
        for thread in [*threads, late]:
            thread.join(20)
        assert [answers[n]["node_rank"] for n in "abc"] == [0, 1, 2], answers
        assert answers["c"]["change"].startswith(
            "joined: node 2 (c, rank 2): going on with 3 node(s)"
        ), answers["c"]["change"]
    finally:
        for client in clients:
            client.close()
        server.close()
    with pytest.raises(RendezvousError, match=f"the rendezvous at {endpoint} did not"):
        clients[0].join("127.0.0.1", find_free_port())


@pytest.mark.backend_neutral  # the rendezvous alone, in this process
def test_a_node_whose_heartbeat_heard_the_end_finishes_when_the_server_closes():
    """The serving node closes once every node was answered after the job
    finished; when a node's heartbeat got that answer (not its main thread),
    its wait still ends with `finished`, not with the server named lost."""
    from keras_dist.cluster.elastic_rendezvous import (  # noqa: PLC0415
        RendezvousClient,
        RendezvousServer,
    )

    endpoint = f"127.0.0.1:{find_free_port()}"
    server = RendezvousServer(
        endpoint, min_nodes=2, max_nodes=2, max_restarts=0, node_timeout=1.0
    )
    first, second = (
        RendezvousClient(endpoint, name, timeout=20, node_timeout=1.0)
        for name in ("a", "b")
    )
    closed = False
    try:
        threads = [
            threading.Thread(target=c.join, args=("127.0.0.1", find_free_port()))
            for c in (first, second)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        second.start_heartbeat()
        second.ended(0, "")  # b's processes succeeded first: the job runs on
        assert second.poll() == "running"
        first.ended(0, "")  # the serving node's succeed last: finished
        deadline = time.monotonic() + 10
        while second.poll() != "finished":  # b's heartbeat heard it
            assert time.monotonic() < deadline, second.poll()
            time.sleep(0.05)
        server.wait_for_nodes_to_hear()
        server.close()
        closed = True
        started = time.monotonic()
        assert second.wait_finished() == "finished"
        assert time.monotonic() - started < 1.0
    finally:
        for client in (first, second):
            client.close()
        if not closed:
            server.close()


@pytest.mark.backend_neutral  # the launcher and its rendezvous alone
def test_a_node_waiting_for_others_ends_on_sigterm_or_after_the_rdzv_timeout(tmp_path):
    """`--nnodes 2:2` with one node only: it waits for a round, never starting
    its process; SIGTERM ends it at once (143), and without one
    `--rdzv-timeout 2` ends it after 2 s (1), each saying why."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never started')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}

    def command(*flags: str) -> list[str]:
        return _nodes_command("2:2", *flags, str(script))

    waiting = subprocess.Popen(command(), env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    waiting.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, log = waiting.communicate(timeout=30)
    assert waiting.returncode == 143, log
    assert time.monotonic() - started < 5, log
    assert "received SIGTERM while waiting for a round" in log, log
    assert "never started" not in log, log
    started = time.monotonic()
    ended = subprocess.run(
        command("--rdzv-timeout", "2"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.returncode == 1, ended.stderr
    assert "no round of the elastic job formed in 2 s" in ended.stderr, ended.stderr
    assert time.monotonic() - started < 20, ended.stderr
