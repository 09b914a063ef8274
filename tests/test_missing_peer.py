"""One side of the job missing, or its port taken (issue 11, item 5).

Real processes under the current backend, each joining a 2-process job whose
other process never starts (or whose coordinator port another socket holds).
Each must end within the initialize timeout plus a few seconds, with a Python
error (exit code 1, not a signal) naming the missing rank and the address, and
leave no process behind.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import keras
import pytest

from keras_dist import cluster
from keras_dist.cluster import find_free_port, roll_call

BACKEND = keras.backend.backend()
TIMEOUT_SECONDS = 5
# What the process may take past the timeout to end, from `initialize` on (the
# target is 2 s; the CI machine is 2 busy cores).
SLACK_SECONDS = 15
# Starting Python and the backend, on the same busy machine.
START_SECONDS = 120

# Keras (and with it the backend and keras_dist's API) loads before the mark:
# the bound is on `initialize`, not on importing TensorFlow or torch.
JOIN = """
import sys, time
import keras
import keras_dist
print("initialize", time.time(), file=sys.stderr, flush=True)
keras_dist.initialize()
print("joined", flush=True)
"""


def process_env(**variables: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster.ENVIRONMENT_VARIABLES
        and not name.startswith(("SLURM_", "KERAS_DIST", "TORCHELASTIC_"))
    }
    env.update(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_INIT_TIMEOUT=str(TIMEOUT_SECONDS))
    if BACKEND == "jax":
        env["KERAS_DIST_CPU_DEVICES"] = "1"
    env.update(variables)
    return env


def rank_env(address: str, rank: int, **variables: str) -> dict[str, str]:
    return process_env(
        KERAS_DISTRIBUTION_JOB_ADDRESSES=address,
        KERAS_DISTRIBUTION_NUM_PROCESSES="2",
        KERAS_DISTRIBUTION_PROCESS_ID=str(rank),
        **variables,
    )


def _default_sigint() -> None:
    # As from a terminal: a test runner's worker may ignore SIGINT, and a
    # child inherits that (Python then installs no KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(env: dict[str, str]) -> subprocess.Popen:
    # Its own session: whatever it starts is in its process group.
    return subprocess.Popen(
        [sys.executable, "-c", JOIN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def assert_group_gone(process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"processes of group {process.pid} are still running")


def finish(process: subprocess.Popen) -> tuple[str, float]:
    """Wait for `process`; return its stderr and the seconds from its call
    to `initialize` to its end."""
    try:
        _, stderr = process.communicate(timeout=START_SECONDS + TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=30)
        raise
    ended = time.time()
    assert_group_gone(process)
    marks = [line.split() for line in stderr.splitlines()]
    started = [float(mark[1]) for mark in marks if mark[:1] == ["initialize"]]
    assert started, stderr[-3000:]
    return stderr, ended - started[0]


def assert_python_error(process: subprocess.Popen, stderr: str) -> None:
    # A Python exception: exit code 1, not an abort (134) or a signal.
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" in stderr and "RuntimeError" in stderr, stderr[-3000:]


def tf_config_env(own: str, other: str, **variables: str) -> dict[str, str]:
    """Worker 0 of a real two-worker `TF_CONFIG` cluster."""
    config = {
        "cluster": {"worker": [own, other]},
        "task": {"type": "worker", "index": 0},
    }
    return process_env(TF_CONFIG=json.dumps(config), **variables)


def test_a_missing_side_or_a_taken_port_is_named_in_time():
    # The cases run at once, each on its own port: they are mostly waiting.
    address_0, address_1 = (f"127.0.0.1:{find_free_port()}" for _ in range(2))
    within_timeout = (TIMEOUT_SECONDS - 1, TIMEOUT_SECONDS + SLACK_SECONDS)
    # case: (environment, texts stderr must hold, bounds on the seconds
    # from `initialize` to the end)
    cases = {
        "process 0 alone": (
            rank_env(address_0, 0),
            [
                f"coordinator {address_0} for process 1, which never checked in",
                "KERAS_DIST_INIT_TIMEOUT",
            ],
            within_timeout,
        ),
        "process 1 alone": (
            rank_env(address_1, 1),
            [
                f"Process 1 of 2 could not reach the job's coordinator at {address_1}",
                "process 0 never listened there",
            ],
            within_timeout,
        ),
    }
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = f"127.0.0.1:{holder.getsockname()[1]}"
    cases["a port in use"] = (
        # A long timeout: the taken port must be reported at once.
        rank_env(taken, 0, KERAS_DIST_INIT_TIMEOUT="60"),
        [f"coordinator at {taken}: port", "is already in use on this host"],
        (0, SLACK_SECONDS),
    )
    if BACKEND == "tensorflow":
        own, other = f"127.0.0.1:{find_free_port()}", f"127.0.0.1:{find_free_port()}"
        cases["TF_CONFIG worker 0 alone"] = (
            tf_config_env(own, other),
            [
                f"coordinator {own} for process 1 (TF_CONFIG worker 1 at {other}), "
                "which never checked in"
            ],
            within_timeout,
        )
    processes = {case: start(env) for case, (env, _, _) in cases.items()}
    try:
        # One waiting thread each, so that each end is timed when it happens.
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
            ended = dict(
                zip(processes, pool.map(finish, processes.values()), strict=True)
            )
    finally:
        holder.close()
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate(timeout=30)
    for case, (stderr, seconds) in ended.items():
        print(f"{BACKEND}: {case}: ended {seconds:.1f} s after initialize")
        _, texts, (low, high) = cases[case]
        assert_python_error(processes[case], stderr)
        assert low < seconds < high, (case, seconds, stderr[-3000:])
        for text in texts:
            assert text in stderr, (case, stderr[-3000:])
        assert "Failed to start RPC server" not in stderr


def test_process_zero_waiting_for_the_others_stops_on_ctrl_c():
    address = f"127.0.0.1:{find_free_port()}"
    env = rank_env(address, 0, KERAS_DIST_INIT_TIMEOUT="60")
    if BACKEND == "tensorflow":  # where TensorFlow ignored signals: TF_CONFIG
        other = f"127.0.0.1:{find_free_port()}"
        env = tf_config_env(address, other, KERAS_DIST_INIT_TIMEOUT="60")
    process = start(env)
    before = []
    # Reading its output blocks: kill it if it never gets to initialize.
    watchdog = threading.Timer(START_SECONDS, process.kill)
    watchdog.start()
    try:
        for line in process.stderr:
            before.append(line)
            if line.startswith("initialize"):
                break
        time.sleep(1.0)  # inside initialize, waiting for process 1
        process.send_signal(signal.SIGINT)
        interrupted = time.time()
        _, stderr = process.communicate(timeout=SLACK_SECONDS + 30)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=30)
    seconds = time.time() - interrupted
    assert_group_gone(process)
    print(f"{BACKEND}: Ctrl-C ended the waiting process 0 in {seconds:.1f} s")
    assert seconds < SLACK_SECONDS, stderr
    assert "KeyboardInterrupt" in stderr, "".join(before) + stderr[-3000:]


@pytest.mark.backend("tensorflow")
def test_tf_config_workers_started_together_join_on_the_checked_port():
    # The roll call uses worker 0's own TF_CONFIG port, which TensorFlow's
    # server binds right after it: both workers must still join.
    addresses = [f"127.0.0.1:{find_free_port()}" for _ in range(2)]
    processes = []
    for index in (1, 0):
        config = {
            "cluster": {"worker": addresses},
            "task": {"type": "worker", "index": index},
        }
        env = process_env(TF_CONFIG=json.dumps(config), KERAS_DIST_INIT_TIMEOUT="60")
        processes.append(start(env))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=START_SECONDS))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate(timeout=30)
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert_group_gone(process)
        assert process.returncode == 0, stderr[-3000:]
        assert "joined" in stdout


# -- the roll call itself, in threads of this process -------------------------------
def roll_call_in_threads(calls: dict[int, dict], address: str) -> dict[int, str | None]:
    """Run `roll_call(address, **calls[rank])` for each rank at once; return
    each rank's error message (None when it returned)."""
    errors: dict[int, str | None] = {}

    def run(rank: int) -> None:
        try:
            roll_call.roll_call(address, process_id=rank, **calls[rank])
            errors[rank] = None
        except RuntimeError as error:
            errors[rank] = str(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def test_roll_call_frees_the_port_for_the_backend_at_once():
    address = f"127.0.0.1:{find_free_port()}"
    calls = {rank: {"num_processes": 3, "timeout_seconds": 20} for rank in (2, 1, 0)}
    assert roll_call_in_threads(calls, address) == {0: None, 1: None, 2: None}
    # Bound without SO_REUSEADDR: no TIME_WAIT left on the coordinator's side.
    with socket.socket() as backend:
        backend.bind(("0.0.0.0", int(address.rsplit(":", 1)[1])))
        backend.listen()


def test_every_process_that_came_names_the_one_that_did_not():
    address = f"127.0.0.1:{find_free_port()}"
    calls = {rank: {"num_processes": 3, "timeout_seconds": 1} for rank in (1, 0)}
    errors = roll_call_in_threads(calls, address)
    assert "for process 2, which never checked in (2 of the job's 3" in errors[0]
    assert errors[1].startswith("Process 1 of 3 stops, process 0 gave up: ")
    assert errors[1].endswith(errors[0])


@pytest.mark.parametrize(
    "count, first, second, message",
    [
        (2, (0,), (1, 3), "as process 1 of 3, but process 0 runs a job of 2"),
        (2, (0,), (2, 2), "as process 2 of 2, but process 0 runs a job of 2"),
        (3, (0, 1), (1, 3), "Two processes checked in"),
    ],
)
def test_inconsistent_ranks_are_named(count, first, second, message):
    address = f"127.0.0.1:{find_free_port()}"
    calls = {rank: {"num_processes": count, "timeout_seconds": 10} for rank in first}
    waiting = threading.Thread(
        target=lambda: errors.update(roll_call_in_threads(calls, address))
    )
    errors: dict[int, str | None] = {}
    waiting.start()
    time.sleep(0.3)
    rank, claimed_count = second
    with pytest.raises(RuntimeError, match="process 0 gave up") as info:
        roll_call.roll_call(address, claimed_count, rank, timeout_seconds=10)
    waiting.join(timeout=30)
    assert message in str(info.value)
    for rank in first:
        assert message in errors[rank] and address in errors[rank], errors


def test_something_else_at_the_coordinator_port_is_named():
    address = f"127.0.0.1:{find_free_port()}"
    sender = threading.Thread(
        target=lambda: socket.create_connection(
            ("127.0.0.1", int(address.rsplit(":", 1)[1]))
        ).sendall(b"GET / HTTP/1.1\n"),
    )
    timer = threading.Timer(0.3, sender.start)
    timer.start()
    with pytest.raises(RuntimeError, match="not a keras_dist check-in"):
        roll_call.roll_call(address, 2, 0, timeout_seconds=10)
    timer.join()
    sender.join(timeout=10)


def test_a_coordinator_that_never_answers_is_named():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="no keras_dist coordinator answered"):
            roll_call.roll_call(address, 2, 1, timeout_seconds=0.5)


def test_process_zero_going_away_after_the_check_in_is_named():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def answer_then_leave() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b'{"seconds_left": 0.1}\n')

        thread = threading.Thread(target=answer_then_leave)
        thread.start()
        with pytest.raises(RuntimeError, match="process 0 went away"):
            roll_call.roll_call(address, 2, 1, timeout_seconds=10)
        thread.join(timeout=10)


def test_a_port_that_cannot_be_opened_is_named(monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket, "create_server", refuse)
    with pytest.raises(RuntimeError, match=r"address 127\.0\.0\.1:80 \(\[Errno 13\]"):
        roll_call.roll_call("127.0.0.1:80", 2, 0, timeout_seconds=1)


def test_tf_config_names_tasks_and_torchrun_agent_store_skips(monkeypatch):
    for name in cluster.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    config = {
        "cluster": {"chief": ["c:1"], "worker": ["w:2", "w:3"]},
        "task": {"type": "chief", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    describe = roll_call._describe_from_tf_config("c:1", 3)
    assert describe(2) == "2 (TF_CONFIG worker 1 at w:3)"
    # A job formed elsewhere (other coordinator or size): TF_CONFIG is stale.
    assert roll_call._describe_from_tf_config("h:9", 3) is str
    assert roll_call._describe_from_tf_config("c:1", 2) is str
    # Under torchrun's agent store nothing listens or connects.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    roll_call.check_in_everyone("127.0.0.1:9", 2, 1, timeout_seconds=0.1)
