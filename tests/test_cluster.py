"""Cluster detection: torchrun, SLURM and TF_CONFIG, their precedence, and
joining a job in bounded time.

Backend-neutral except the real-process tests at the end, which run under the
backend they name.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import keras
import pytest

import keras_dist as kd
from keras_dist import cluster
from keras_dist.backends import get_adapter
from keras_dist.cluster import (
    SlurmEnvironment,
    TFConfigEnvironment,
    TorchrunEnvironment,
    detect_cluster,
    expand_hostlist,
    find_free_port,
)
from keras_dist.common import job
from keras_dist.runtime import api as runtime

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

BACKEND = keras.backend.backend()


def escaped(text: str) -> str:
    return re.escape(text)


def is_cluster_variable(name: str) -> bool:
    return (
        name in cluster.ENVIRONMENT_VARIABLES
        or name.startswith(("SLURM_", "KERAS_DISTRIBUTION_"))
        or name == "KERAS_DIST_INIT_TIMEOUT"
    )


@pytest.fixture(autouse=True)
def _clean_cluster_environment(monkeypatch):
    """No launcher variable of the surrounding shell (an `srun` running the
    tests, say) leaks into these tests."""
    for name in list(os.environ):
        if is_cluster_variable(name):
            monkeypatch.delenv(name)


def set_torchrun(monkeypatch, rank="1", world_size="4", addr="10.0.0.1", port="29500"):
    for name, value in {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }.items():
        if value is not None:
            monkeypatch.setenv(name, value)


def set_slurm(monkeypatch, procid="2", ntasks="4", nodelist="node[07-09]"):
    monkeypatch.setenv("SLURM_PROCID", procid)
    monkeypatch.setenv("SLURM_NTASKS", ntasks)
    if nodelist is not None:
        monkeypatch.setenv("SLURM_STEP_NODELIST", nodelist)


def set_tf_config(monkeypatch, config):
    monkeypatch.setenv(
        "TF_CONFIG", config if isinstance(config, str) else json.dumps(config)
    )


THREE_TASKS = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}


def resolved():
    environment = detect_cluster()
    return (
        environment.coordinator_address(),
        environment.num_processes(),
        environment.process_id(),
    )


# -- detection ------------------------------------------------------------------
def test_no_cluster_is_one_process():
    assert detect_cluster() is None
    assert runtime.resolve_cluster() == (None, 1, 0)


def test_torchrun_detected(monkeypatch):
    set_torchrun(monkeypatch)
    assert isinstance(detect_cluster(), TorchrunEnvironment)
    assert resolved() == ("10.0.0.1:29500", 4, 1)
    assert runtime.resolve_cluster() == ("10.0.0.1:29500", 4, 1)
    assert detect_cluster().local_process_id() is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert detect_cluster().local_process_id() == 3


def test_torchrun_ipv6_master_address_gets_brackets(monkeypatch):
    set_torchrun(monkeypatch, addr="::1")
    assert runtime.resolve_cluster() == ("[::1]:29500", 4, 1)


def test_torchrun_master_variables_alone_are_not_a_cluster(monkeypatch):
    # Batch scripts export these for other tools; without RANK/WORLD_SIZE
    # nothing says this process is part of a job.
    set_torchrun(monkeypatch, rank=None, world_size=None)
    assert detect_cluster() is None


def test_slurm_detected(monkeypatch):
    set_slurm(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "login[1-2]")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert isinstance(detect_cluster(), SlurmEnvironment)
    # The step's node list wins over the job's; the port is the default.
    assert runtime.resolve_cluster() == ("node07:12355", 4, 2)
    assert detect_cluster().local_process_id() == 0


def test_slurm_job_nodelist_and_configured_port(monkeypatch):
    set_slurm(monkeypatch, procid="0", ntasks="2", nodelist=None)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[12,3],cpu1")
    monkeypatch.setenv("KERAS_DIST_COORDINATOR_PORT", "23456")
    assert runtime.resolve_cluster() == ("gpu12:23456", 2, 0)


@pytest.mark.parametrize("present", ["SLURM_PROCID", "SLURM_NTASKS"])
def test_slurm_needs_both_rank_and_task_count(monkeypatch, present):
    # An salloc shell has only SLURM_NTASKS, an sbatch script without
    # --ntasks only SLURM_PROCID: both are single processes.
    monkeypatch.setenv(present, "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    assert detect_cluster() is None
    assert runtime.resolve_cluster() == (None, 1, 0)


@pytest.mark.parametrize(
    ("task", "expected_rank"),
    [({"type": "chief", "index": 0}, 0), ({"type": "worker", "index": 1}, 2)],
)
def test_tf_config_with_chief(monkeypatch, task, expected_rank):
    set_tf_config(monkeypatch, {"cluster": THREE_TASKS, "task": task})
    assert isinstance(detect_cluster(), TFConfigEnvironment)
    assert runtime.resolve_cluster() == ("h0:2222", 3, expected_rank)
    assert detect_cluster().local_process_id() is None


def test_tf_config_workers_only(monkeypatch):
    config = {
        "cluster": {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]},
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    set_tf_config(monkeypatch, config)
    assert runtime.resolve_cluster() == ("w0:1", 2, 1)


def test_tf_config_one_worker_is_one_process(monkeypatch):
    set_tf_config(
        monkeypatch,
        {"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": 0}},
    )
    assert runtime.resolve_cluster() == ("w0:1", 1, 0)


# -- detection order and precedence ---------------------------------------------
def test_torchrun_wins_over_slurm_and_tf_config(monkeypatch):
    # `srun torchrun ...`: torchrun's variables describe the training processes.
    set_torchrun(monkeypatch)
    set_slurm(monkeypatch, procid="0", ntasks="2")
    set_tf_config(monkeypatch, "not even json")
    assert isinstance(detect_cluster(), TorchrunEnvironment)
    assert runtime.resolve_cluster() == ("10.0.0.1:29500", 4, 1)


def test_slurm_wins_over_tf_config(monkeypatch):
    set_slurm(monkeypatch)
    set_tf_config(monkeypatch, "not even json")
    assert isinstance(detect_cluster(), SlurmEnvironment)
    assert runtime.resolve_cluster() == ("node07:12355", 4, 2)


def test_keras_distribution_variables_win_over_the_cluster(monkeypatch):
    set_torchrun(monkeypatch)
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "env:1")
    assert runtime.resolve_cluster() == ("env:1", 4, 1)
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "0")
    assert runtime.resolve_cluster() == ("env:1", 2, 0)


def test_explicit_arguments_win_over_everything(monkeypatch):
    set_slurm(monkeypatch)
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "env:1")
    assert runtime.resolve_cluster("arg:2") == ("arg:2", 4, 2)
    assert runtime.resolve_cluster(process_id=3) == ("env:1", 4, 3)
    assert runtime.resolve_cluster("arg:2", 8, 5) == ("arg:2", 8, 5)


def test_several_job_addresses_give_the_count_before_the_cluster(monkeypatch):
    set_torchrun(monkeypatch)
    assert runtime.resolve_cluster("a:1,b:2") == ("a:1", 2, 1)


def test_one_process_asked_for_skips_the_cluster(monkeypatch):
    # The override for a script started by an sbatch script without srun.
    set_slurm(monkeypatch, procid="0", ntasks="4", nodelist="node[1-")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")
    assert runtime.resolve_cluster() == (None, 1, 0)


def test_complete_arguments_skip_a_malformed_cluster(monkeypatch):
    set_torchrun(monkeypatch, rank="one", port="http")
    assert runtime.resolve_cluster("a:1", 2, 1) == ("a:1", 2, 1)


def test_count_that_disagrees_with_the_cluster_names_both_sources(monkeypatch):
    set_torchrun(monkeypatch, rank="3")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match=escaped("process_id=3, num_processes=2")) as e:
        runtime.resolve_cluster()
    assert "process_id from RANK" in str(e.value)
    assert "num_processes from KERAS_DISTRIBUTION_NUM_PROCESSES" in str(e.value)


# -- errors: torchrun -----------------------------------------------------------
@pytest.mark.parametrize(
    ("missing", "received"),
    [
        ("WORLD_SIZE", "RANK='1'"),
        ("RANK", "WORLD_SIZE='4'"),
        ("MASTER_ADDR", "MASTER_PORT='29500'"),
        ("MASTER_PORT", "MASTER_ADDR='10.0.0.1'"),
    ],
)
def test_torchrun_incomplete(monkeypatch, missing, received):
    set_torchrun(monkeypatch)
    monkeypatch.delenv(missing)
    with pytest.raises(ValueError, match=escaped(f"{missing} is missing")) as info:
        runtime.resolve_cluster()
    assert received in str(info.value)


def test_torchrun_rank_alone(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    message = "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are missing. Received: RANK='1'"
    with pytest.raises(ValueError, match=escaped(message)):
        runtime.resolve_cluster()


@pytest.mark.parametrize(
    ("rank", "world_size", "message"),
    [
        ("4", "4", "RANK=4, WORLD_SIZE=4"),
        ("-1", "4", "RANK=-1, WORLD_SIZE=4"),
        ("0", "0", "WORLD_SIZE=0"),
        ("one", "4", "RANK='one'"),
        ("--1", "4", "RANK='--1'"),
        ("0", "4.0", "WORLD_SIZE='4.0'"),
    ],
)
def test_torchrun_rank_and_size_invalid(monkeypatch, rank, world_size, message):
    set_torchrun(monkeypatch, rank=rank, world_size=world_size)
    with pytest.raises(ValueError, match=escaped(message)):
        runtime.resolve_cluster()


@pytest.mark.parametrize("port", ["0", "65536", "http", "8²"])
def test_torchrun_master_port_invalid(monkeypatch, port):
    set_torchrun(monkeypatch, port=port)
    with pytest.raises(ValueError, match=escaped(f"MASTER_PORT={port!r}")):
        runtime.resolve_cluster()


def test_torchrun_local_rank_invalid(monkeypatch):
    set_torchrun(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match=escaped("LOCAL_RANK=-1")):
        detect_cluster().local_process_id()


# -- errors: SLURM --------------------------------------------------------------
@pytest.mark.parametrize(
    ("procid", "ntasks", "message"),
    [
        ("4", "4", "SLURM_PROCID=4, SLURM_NTASKS=4"),
        ("-1", "2", "SLURM_PROCID=-1, SLURM_NTASKS=2"),
        ("0", "0", "SLURM_NTASKS=0"),
        ("first", "2", "SLURM_PROCID='first'"),
    ],
)
def test_slurm_rank_and_size_invalid(monkeypatch, procid, ntasks, message):
    set_slurm(monkeypatch, procid=procid, ntasks=ntasks)
    with pytest.raises(ValueError, match=escaped(message)):
        runtime.resolve_cluster()


def test_slurm_without_a_nodelist(monkeypatch):
    set_slurm(monkeypatch, nodelist=None)
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST or SLURM_JOB_NOD") as e:
        runtime.resolve_cluster()
    assert "SLURM_PROCID='2', SLURM_NTASKS='4'" in str(e.value)


def test_slurm_malformed_nodelist_names_the_variable(monkeypatch):
    set_slurm(monkeypatch, nodelist="node[3-1]")
    with pytest.raises(ValueError, match=escaped("SLURM_STEP_NODELIST='node[3-1]'")):
        runtime.resolve_cluster()


@pytest.mark.parametrize("port", ["0", "99999", "auto"])
def test_slurm_coordinator_port_invalid(monkeypatch, port):
    set_slurm(monkeypatch)
    monkeypatch.setenv("KERAS_DIST_COORDINATOR_PORT", port)
    with pytest.raises(
        ValueError, match=escaped(f"KERAS_DIST_COORDINATOR_PORT={port!r}")
    ):
        runtime.resolve_cluster()


# -- errors: TF_CONFIG ----------------------------------------------------------
WORKER_0 = {"type": "worker", "index": 0}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{cluster:", "is not valid JSON"),
        ("[]", "must be a JSON object with a 'cluster' object"),
        ({"cluster": ["h0:1"]}, "must be a JSON object with a 'cluster' object"),
        ({"cluster": {"worker": "h0:1"}}, "cluster.worker must be a list"),
        ({"cluster": {"chief": [1]}}, "cluster.chief must be a list"),
        ({"cluster": {"worker": ["nohost"]}}, "holds 'nohost', not a 'host:port'"),
        ({"cluster": {"chief": ["a:1", "b:1"]}}, "more than one cluster.chief"),
        ({"cluster": {"ps": ["p:1"]}}, "no cluster.chief or cluster.worker"),
        ({"cluster": {"worker": ["w:1"]}}, "needs a 'task' object"),
        (
            {"cluster": {"worker": ["w:1"]}, "task": {"type": "ps", "index": 0}},
            "got 'ps'",
        ),
        (
            {"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": "0"}},
            "task.index must be an int; got '0'",
        ),
        (
            {"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": True}},
            "task.index must be an int; got True",
        ),
        (
            {"cluster": THREE_TASKS, "task": {"type": "worker", "index": 2}},
            "task.index=2 is out of range: cluster.worker lists 2",
        ),
        (
            {"cluster": THREE_TASKS, "task": {"type": "chief", "index": -1}},
            "task.index=-1 is out of range: cluster.chief lists 1",
        ),
    ],
)
def test_tf_config_invalid(monkeypatch, config, message):
    set_tf_config(monkeypatch, config)
    with pytest.raises(ValueError, match=escaped(message)) as info:
        runtime.resolve_cluster()
    assert f"TF_CONFIG={os.environ['TF_CONFIG']!r}" in str(info.value)


# -- SLURM host lists -----------------------------------------------------------
@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a,b[3]", ["a", "b3"]),
        (
            "rack[1-2]-node[01-02]",
            ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
        ),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("host.example.com", ["host.example.com"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("node[1-", "'[' without ']'"),
        ("node]1", "']' without '['"),
        ("node[[1]]", "nested '['"),
        ("a,,b", "an empty host name"),
        ("", "an empty host name"),
        ("node[a-b]", "[a-b] is not a list of numbers"),
        ("node[]", "[] is not a list of numbers"),
        ("node[1,]", "[1,] is not a list of numbers"),
        ("node[3-1]", "the range 3-1 runs backwards"),
    ],
)
def test_expand_hostlist_malformed(nodelist, why):
    with pytest.raises(ValueError, match=escaped(why)) as info:
        expand_hostlist(nodelist, name="SLURM_JOB_NODELIST")
    assert f"SLURM_JOB_NODELIST={nodelist!r}" in str(info.value)


# -- initialize: autodetection and waiting for the coordinator ----------------------
@pytest.fixture
def joins(monkeypatch):
    """Record what `initialize` hands the adapter instead of joining a job."""
    calls = []
    monkeypatch.setattr(job, "_joined", {})
    # No other process checks in here (tests/test_missing_peer.py covers it).
    monkeypatch.setattr(runtime, "check_in_everyone", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        get_adapter(),
        "initialize",
        lambda *args, **kwargs: calls.append((args, kwargs)),
    )
    return calls


@pytest.fixture
def listener():
    """A socket listening on a free loopback port; yields its port."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def test_initialize_without_arguments_uses_the_cluster(monkeypatch, joins):
    set_torchrun(monkeypatch, rank="0", world_size="2", addr="127.0.0.1")
    kd.initialize(timeout_seconds=7)
    assert joins == [(("127.0.0.1:29500", 2, 0), {"timeout_seconds": 7})]


def test_initialize_waits_for_a_listening_coordinator(monkeypatch, joins, listener):
    monkeypatch.setenv("KERAS_DIST_INIT_TIMEOUT", "9")
    kd.initialize(f"127.0.0.1:{listener}", 2, 1)
    # The backend gets the whole timeout for its own handshake.
    assert joins == [((f"127.0.0.1:{listener}", 2, 1), {"timeout_seconds": 9.0})]


def test_initialize_waits_for_a_coordinator_that_starts_late(joins):
    port = find_free_port()
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    starter = threading.Timer(0.5, server.listen)
    starter.start()
    try:
        kd.initialize(f"127.0.0.1:{port}", 2, 1, timeout_seconds=20)
    finally:
        starter.cancel()
        server.close()
    assert len(joins) == 1


def test_initialize_unreachable_coordinator_fails_in_time(joins):
    address = f"127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=escaped(address)) as info:
        kd.initialize(address, 3, 2, timeout_seconds=0.5)
    assert time.monotonic() - start < 5
    assert "Process 2 of 3" in str(info.value)
    assert "KERAS_DIST_INIT_TIMEOUT" in str(info.value)
    assert joins == []


def test_initialize_process_zero_does_not_wait(joins):
    # Process 0 starts the coordinator itself.
    address = f"127.0.0.1:{find_free_port()}"
    kd.initialize(address, 2, 0, timeout_seconds=0.5)
    assert joins == [((address, 2, 0), {"timeout_seconds": 0.5})]


# -- real processes -----------------------------------------------------------------
def python_env(backend: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not is_cluster_variable(name) and name != "KERAS_DIST_CPU_DEVICES"
    }
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    if backend == "jax":
        env["KERAS_DIST_CPU_DEVICES"] = "1"
    return env


UNREACHABLE = """
import keras_dist
keras_dist.initialize("{address}", 2, 1, timeout_seconds=5)
"""


@pytest.mark.backend("jax", "torch")
def test_unreachable_coordinator_ends_the_process_in_time():
    address = f"127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", UNREACHABLE.format(address=address)],
        env=python_env(BACKEND),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert time.monotonic() - start < 60
    # A Python error (exit 1), not JAX's abort (134) that names no address.
    assert result.returncode == 1, result.stderr[-3000:]
    assert address in result.stderr, result.stderr[-3000:]
    assert "Process 1 of 2" in result.stderr


JOIN = """
import keras_dist
keras_dist.initialize()
print("joined", keras_dist.num_processes(), keras_dist.process_id(), flush=True)
"""


@pytest.mark.backend("jax", "torch")
def test_torchrun_variables_join_a_real_job():
    port = find_free_port()
    children = []
    try:
        # Rank 1 first: it waits for rank 0's coordinator to come up.
        for rank in (1, 0):
            env = python_env(BACKEND)
            env.update(
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                KERAS_DIST_INIT_TIMEOUT="60",
            )
            children.append(
                subprocess.Popen(
                    [sys.executable, "-c", JOIN],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = [child.communicate(timeout=150) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    for (_, stderr), child in zip(outputs, children, strict=True):
        assert child.returncode == 0, stderr[-3000:]
    assert [stdout.split()[-3:] for stdout, _ in outputs] == [
        ["joined", "2", "1"],
        ["joined", "2", "0"],
    ]
