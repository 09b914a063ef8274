"""`keras-dist launch`: environment per rank, output, exit codes, stopping.

Backend-neutral: the launched scripts use only the standard library, so these
tests run the same under every `KERAS_BACKEND`. Most tests call the CLI in
this process (`cli.main`), which is fast; the signal tests start the launcher
as its own process so that a signal cannot reach pytest.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist import cli
from keras_dist.cluster import launcher

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]
LAUNCHER_FILE = REPOSITORY / "keras_dist" / "cluster" / "launcher.py"
TIMEOUT_SECONDS = 120  # a launcher process imports keras and a backend first

RANK_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
    "KERAS_DIST_LOCAL_RANK",
    "KERAS_DIST_RESTART_COUNT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

PRINT_ENV = f"""
import json, os
print(json.dumps({{name: os.environ.get(name) for name in {RANK_VARIABLES!r}}}))
"""

# Records pids in the folder argv[1] as `pid-<rank>[-suffix]`, atomically.
PID_FILE_HELPERS = """
import os, pathlib, subprocess, sys, time

PIDS = pathlib.Path(sys.argv[1])

def write_pid(pid, suffix=""):
    name = f"{os.environ['RANK']}{suffix}"
    (PIDS / f"tmp-{name}").write_text(str(pid))
    (PIDS / f"tmp-{name}").rename(PIDS / f"pid-{name}")

def sleep_forever():
    while True:
        time.sleep(1)
"""

# Starts a sleeping grandchild and records both pids.
START_GRANDCHILD = """
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
write_pid(grandchild.pid, "-grandchild")
write_pid(os.getpid())
"""


def write_script(folder: pathlib.Path, *parts: str) -> str:
    """A script made of the dedented `parts`, one after the other."""
    path = folder / "child.py"
    path.write_text("\n".join(textwrap.dedent(part) for part in parts))
    return str(path)


def run_cli(argv: list[str], capfd) -> tuple[int, str, str]:
    exit_code = cli.main(["launch", *argv])
    out, err = capfd.readouterr()
    return exit_code, out, err


def rank_lines(text: str) -> dict[int, list[str]]:
    """`{rank: [line, ...]}` from `[rank N] line` output."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            rank, _, rest = line[len("[rank ") :].partition("] ")
            lines.setdefault(int(rank), []).append(rest)
    return lines


def is_alive(pid: int) -> bool:
    # An unreaped zombie still answers kill(pid, 0) but runs nothing.
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2]
    except FileNotFoundError:
        return False
    return state.split()[0] not in ("Z", "X")


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def read_pids(folder: pathlib.Path) -> list[int]:
    return [int(path.read_text()) for path in folder.glob("pid-*")]


@pytest.fixture
def pid_folder(tmp_path):
    """A folder the scripts write their pids to; leftovers are killed after."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    for pid in read_pids(folder):
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    """The launcher sets these itself; none leaks in from the shell."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def launcher_process(argv: list[str], tmp_path: pathlib.Path, *, cli_entry: bool):
    """The launcher as its own process, in its own session, output in files."""
    env = None
    if cli_entry:
        command = [sys.executable, "-m", "keras_dist", "launch", *argv]
    else:
        # Load launcher.py by path: no keras, no backend, a fast start.
        command = [sys.executable, "-c", LOAD_LAUNCHER_ONLY, *argv]
        env = launcher_environment()
    out = (tmp_path / "launcher.out").open("wb")
    err = (tmp_path / "launcher.err").open("wb")
    process = subprocess.Popen(
        command,
        stdout=out,
        stderr=err,
        start_new_session=True,
        cwd=REPOSITORY,
        env=env,
    )
    out.close()
    err.close()
    return process


LOAD_LAUNCHER_ONLY = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("launcher", {str(LAUNCHER_FILE)!r})
module = importlib.util.module_from_spec(spec)
sys.modules["launcher"] = module
spec.loader.exec_module(module)
# keras_dist's package itself is light; only its cluster/ modules may load.
# (common.tpu_host: the standard library alone, which platforms JAX starts.)
light = ("keras_dist", "keras_dist._version", "keras_dist.distribution",
         "keras_dist.runtime", "keras_dist.runtime.device_simulation",
         "keras_dist.common", "keras_dist.common.tpu_host")
heavy = sorted(
    name for name in sys.modules
    if name.split(".")[0] in ("keras", "keras_dist", "jax", "torch", "tensorflow")
    and name not in light and not name.startswith("keras_dist.cluster")
)
if heavy:
    sys.exit(f"launcher.py imported {{heavy}}")
sys.exit(module.launch(sys.argv[2], sys.argv[3:], nproc_per_node=int(sys.argv[1])))
"""


def launcher_environment() -> dict[str, str]:
    """This environment without the simulated devices the suite sets: with
    `KERAS_DIST_CPU_DEVICES`, importing keras_dist starts the backend, which
    the launcher, whose ranks here use only the standard library, must not."""
    return {k: v for k, v in os.environ.items() if k != "KERAS_DIST_CPU_DEVICES"}


# -- environment ---------------------------------------------------------------
def test_each_rank_gets_the_job_environment(tmp_path, capfd, monkeypatch):
    free_port = launcher.find_free_port()
    monkeypatch.setattr(launcher, "find_free_port", lambda host: free_port)
    script = write_script(tmp_path, PRINT_ENV)

    exit_code, out, _ = run_cli(["--nproc-per-node", "3", script], capfd)

    assert exit_code == 0
    envs = {rank: json.loads(lines[0]) for rank, lines in rank_lines(out).items()}
    assert sorted(envs) == [0, 1, 2]
    for rank, env in envs.items():
        assert env == {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{free_port}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "3",
            "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
            "KERAS_DIST_LOCAL_RANK": str(rank),
            "KERAS_DIST_RESTART_COUNT": "0",
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port),
        }


def test_single_node_coordinator_port_is_chosen_by_the_os(tmp_path, capfd):
    script = write_script(tmp_path, PRINT_ENV)

    exit_code, out, _ = run_cli(["--nproc-per-node", "2", script], capfd)

    assert exit_code == 0
    envs = [json.loads(lines[0]) for lines in rank_lines(out).values()]
    addresses = {env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] for env in envs}
    assert len(addresses) == 1
    port = int(addresses.pop().rpartition(":")[2])
    # Nobody holds it now: it was free, not a fixed port another job may use.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_find_free_port_returns_a_bindable_port():
    port = launcher.find_free_port()
    assert 0 < port < 65536
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_second_node_gets_the_upper_ranks(tmp_path, capfd):
    coordinator = f"127.0.0.1:{launcher.find_free_port()}"
    script = write_script(tmp_path, PRINT_ENV)
    argv = ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1"]

    exit_code, out, _ = run_cli([*argv, "--coordinator", coordinator, script], capfd)

    assert exit_code == 0
    envs = {rank: json.loads(lines[0]) for rank, lines in rank_lines(out).items()}
    assert sorted(envs) == [2, 3]
    for rank, env in envs.items():
        assert env["KERAS_DISTRIBUTION_PROCESS_ID"] == env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == env["KERAS_DIST_LOCAL_RANK"] == str(rank - 2)
        assert env["KERAS_DISTRIBUTION_NUM_PROCESSES"] == env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "1"
        assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == coordinator
        assert f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" == coordinator


def test_rank_environment_keeps_the_base_and_strips_ipv6_brackets():
    config = launcher.LaunchConfig(__file__, nproc_per_node=2, coordinator="[::1]:29")
    base = {"PATH": "/bin", "PYTHONUNBUFFERED": "0"}

    env = launcher.rank_environment(config, 1, "[::1]:29", base=base)

    assert env["MASTER_ADDR"] == "::1" and env["MASTER_PORT"] == "29"
    assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "[::1]:29"
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "0"
    assert base == {"PATH": "/bin", "PYTHONUNBUFFERED": "0"}


# -- output --------------------------------------------------------------------
def test_output_lines_are_prefixed_with_the_rank_on_their_own_stream(tmp_path, capfd):
    script = write_script(
        tmp_path,
        """
        import os, sys
        rank = os.environ["RANK"]
        print(f"out {rank}\\nsecond out {rank}")
        print(f"err {rank}", file=sys.stderr)
        sys.stdout.write(f"no newline {rank}")
        """,
    )

    exit_code, out, err = run_cli(["--nproc-per-node", "2", script], capfd)

    assert exit_code == 0
    assert rank_lines(out) == {
        rank: [f"out {rank}", f"second out {rank}", f"no newline {rank}"]
        for rank in (0, 1)
    }
    assert rank_lines(err) == {rank: [f"err {rank}"] for rank in (0, 1)}
    assert out.endswith("\n")


def test_output_goes_to_the_given_streams_and_survives_a_closed_one(tmp_path):
    script = write_script(tmp_path, "print('hello'); import sys; sys.exit(4)")
    closed = io.StringIO()
    closed.close()
    stderr = io.StringIO()
    config = launcher.LaunchConfig(script, nproc_per_node=2)

    exit_code = launcher.Launcher(config, stdout=closed, stderr=stderr).run()

    assert exit_code == 4
    assert "exited with code 4" in stderr.getvalue()


# -- exit codes and failures ---------------------------------------------------
def test_success_exits_zero_and_a_failure_passes_its_code_through(tmp_path, capfd):
    script = write_script(
        tmp_path, "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    )
    assert run_cli(["--nproc-per-node", "1", script], capfd)[0] == 0

    exit_code, _, err = run_cli(["--nproc-per-node", "2", script], capfd)

    assert exit_code == 3
    assert "keras-dist: rank 1 exited with code 3" in err


def test_a_failing_rank_stops_its_sleeping_siblings_fast(tmp_path, capfd, pid_folder):
    script = write_script(
        tmp_path,
        PID_FILE_HELPERS,
        START_GRANDCHILD,
        """
        if os.environ["RANK"] == "2":
            # Fail once the others are up, so that there is someone to stop.
            while len(list(PIDS.glob("pid-*"))) < 6:
                time.sleep(0.05)
            sys.exit(3)
        sleep_forever()
        """,
    )
    started = time.monotonic()

    exit_code, _, err = run_cli(
        ["--nproc-per-node", "3", script, str(pid_folder)], capfd
    )

    assert time.monotonic() - started < 30
    assert exit_code == 3
    assert "keras-dist: rank 2 exited with code 3; stopped the other 2 process(es)" in (
        err
    )
    pids = read_pids(pid_folder)
    assert len(pids) == 6  # three ranks, three grandchildren
    assert wait_until(lambda: not any(map(is_alive, pids)), timeout=10)


def test_a_rank_killed_by_a_signal_is_reported_by_signal_name(tmp_path, capfd):
    script = write_script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
        """,
    )

    exit_code, _, err = run_cli(["--nproc-per-node", "2", script], capfd)

    assert exit_code == 128 + signal.SIGKILL
    assert "keras-dist: rank 1 was killed by signal SIGKILL" in err


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, pid_folder):
    script = write_script(
        tmp_path,
        PID_FILE_HELPERS,
        """
        import signal
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_pid(os.getpid())
            sleep_forever()
        while not (PIDS / "pid-0").exists():
            time.sleep(0.05)
        sys.exit(1)
        """,
    )
    started = time.monotonic()

    exit_code = launcher.launch(
        script, [str(pid_folder)], nproc_per_node=2, grace_period_seconds=0.5
    )

    assert exit_code == 1
    assert time.monotonic() - started < 15
    assert not is_alive(read_pids(pid_folder)[0])


def test_describe_exit_names_codes_and_signals():
    assert launcher.describe_exit(0, 3) == "rank 0 exited with code 3"
    assert launcher.describe_exit(2, -signal.SIGTERM) == (
        "rank 2 was killed by signal SIGTERM"
    )
    assert launcher.describe_exit(1, -200) == "rank 1 was killed by signal number 200"


# -- signals to the launcher ---------------------------------------------------
@pytest.mark.parametrize(
    ("signum", "cli_entry"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGINT-to-the-cli", "SIGTERM-to-the-launcher-module"],
)
def test_a_signal_to_the_launcher_ends_every_process(
    tmp_path, pid_folder, signum, cli_entry
):
    script = write_script(
        tmp_path, PID_FILE_HELPERS, START_GRANDCHILD, "sleep_forever()"
    )
    process = launcher_process(
        ["2", script, str(pid_folder)]
        if not cli_entry
        else ["--nproc-per-node", "2", script, str(pid_folder)],
        tmp_path,
        cli_entry=cli_entry,
    )
    try:
        assert wait_until(
            lambda: len(read_pids(pid_folder)) == 4 or process.poll() is not None,
            timeout=TIMEOUT_SECONDS,
        )
        pids = read_pids(pid_folder)
        assert len(pids) == 4, (tmp_path / "launcher.err").read_text()

        process.send_signal(signum)

        assert process.wait(timeout=60) == 128 + signum
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert wait_until(lambda: not any(map(is_alive, pids)), timeout=10)
    err = (tmp_path / "launcher.err").read_text()
    assert f"keras-dist: received {signal.Signals(signum).name}" in err


def test_launcher_module_imports_neither_keras_nor_a_backend(tmp_path):
    script = write_script(tmp_path, "print('ok')")

    result = subprocess.run(
        [sys.executable, "-c", LOAD_LAUNCHER_ONLY, "1", script],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SECONDS,
        env=launcher_environment(),
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "[rank 0] ok\n"


# -- restarts ------------------------------------------------------------------
def test_max_restarts_restarts_the_group_on_a_new_port(tmp_path, capfd, monkeypatch):
    first, second = launcher.find_free_port(), launcher.find_free_port()
    if first == second:  # the OS may hand out the same free port twice
        second = first + 1 if first < 65535 else first - 1
    ports = iter([first, second])
    monkeypatch.setattr(launcher, "find_free_port", lambda host: next(ports))
    script = write_script(
        tmp_path,
        """
        import os, pathlib, sys
        print(os.environ["MASTER_PORT"], os.environ["KERAS_DIST_RESTART_COUNT"])
        marker = pathlib.Path(sys.argv[1]) / "failed-once"
        if os.environ["RANK"] == "0" and not marker.exists():
            marker.touch()
            sys.exit(5)
        """,
    )

    exit_code, out, err = run_cli(
        ["--nproc-per-node", "2", "--max-restarts", "2", script, str(tmp_path)], capfd
    )

    assert exit_code == 0
    assert "keras-dist: rank 0 exited with code 5" in err
    assert "keras-dist: restart 1 of 2: starting all 2 process(es) again" in err
    assert err.count("restart ") == 1
    assert rank_lines(out)[0] == [f"{first} 0", f"{second} 1"]
    assert rank_lines(out)[1][-1] == f"{second} 1"


def test_exit_code_after_the_last_restart_is_the_last_failure(tmp_path, capfd):
    script = write_script(tmp_path, "import sys; sys.exit(7)")

    exit_code, _, err = run_cli(
        ["--nproc-per-node", "1", "--max-restarts", "1", script], capfd
    )

    assert exit_code == 7
    assert err.count("rank 0 exited with code 7") == 2
    assert err.count("restart 1 of 1") == 1


# -- validation ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "received"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nnodes": 0}, "nnodes=0"),
        ({"node_rank": -1}, "node_rank=-1"),
        ({"nnodes": 2, "node_rank": 2, "coordinator": "h:1"}, "node_rank=2"),
        ({"coordinator": "localhost"}, "coordinator='localhost'"),
        ({"coordinator": ":29500"}, "coordinator=':29500'"),
        ({"coordinator": "host:0"}, "coordinator='host:0'"),
        ({"coordinator": "host:65536"}, "coordinator='host:65536'"),
        ({"coordinator": "host:port"}, "coordinator='host:port'"),
        ({"nnodes": 2, "node_rank": 1}, "coordinator=None"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"grace_period_seconds": 0}, "grace_period_seconds=0"),
    ],
)
def test_config_rejects_bad_values(options, received):
    with pytest.raises(ValueError, match=re.escape(f"Received: {received}")):
        launcher.LaunchConfig(__file__, **options)


@pytest.mark.parametrize(
    ("options", "received"),
    [
        ({"nproc_per_node": "2"}, "nproc_per_node='2'"),
        ({"nnodes": True}, "nnodes=True"),
        ({"node_rank": 1.0}, "node_rank=1.0"),
        ({"script_args": "--epochs 3"}, "script_args='--epochs 3'"),
        ({"script_args": ("--epochs", 3)}, "script_args=('--epochs', 3)"),
    ],
)
def test_config_rejects_wrong_types(options, received):
    with pytest.raises(TypeError, match=re.escape(f"Received: {received}")):
        launcher.LaunchConfig(__file__, **options)


def test_config_rejects_a_missing_script(tmp_path):
    missing = str(tmp_path / "missing.py")
    with pytest.raises(ValueError, match=re.escape(f"script='{missing}'")):
        launcher.LaunchConfig(missing)


def test_config_keeps_arguments_as_a_tuple():
    config = launcher.LaunchConfig(__file__, ["--epochs", "3"], nproc_per_node=2)
    assert config.script_args == ("--epochs", "3")
    assert config.world_size == 2


@pytest.mark.parametrize(
    ("argv", "received"),
    [
        (["--nproc-per-node", "0", "{script}"], "Received: --nproc-per-node 0"),
        (["--nproc-per-node", "two", "{script}"], "invalid int value: 'two'"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "{script}"],
            "Received: no --coordinator",
        ),
        (
            ["--nproc-per-node", "2", "--coordinator", "nohost", "{script}"],
            "Received: --coordinator nohost",
        ),
        (["--nproc-per-node", "1", "{missing}"], "missing.py"),
        (["{script}"], "--nproc-per-node"),
    ],
)
def test_cli_usage_errors_exit_with_code_2(tmp_path, capfd, argv, received):
    script = write_script(tmp_path, "print('never runs')")
    argv = [
        part.format(script=script, missing=tmp_path / "missing.py") for part in argv
    ]

    with pytest.raises(SystemExit) as raised:
        cli.main(["launch", *argv])

    assert raised.value.code == 2
    out, err = capfd.readouterr()
    assert received in err and "never runs" not in out


# -- a real engine -------------------------------------------------------------
# Processes of a real backend started by `keras-dist launch` join one job: the
# launched jobs of test_checkpoint_jobs.py (JAX: both ranks save at one agreed
# step and exit 75 together) and test_elastic.py (JAX: "saved by 2
# process(es)"), and each backend's launched ranks in test_fault_lifecycle.py.


# -- a lost rank is the root cause, the others' noise its consequence (issue 25, 10)
GLOO_TERMINATE = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4. Received data size "
    "doesn't match expected size. Is there a distributed collective mismatch in "
    "your code?\n"
)

# Rank 1 sends half a message to rank 0 over loopback and is SIGKILLed; rank 0,
# blocked reading it, reacts as gloo's C++ thread does when a peer dies mid-
# collective: the terminate text on stderr at once, then an abort.
LOST_PEER = f"""
import os, pathlib, signal, socket, sys, time
folder = pathlib.Path(sys.argv[1])
if os.environ["RANK"] == "0":
    server = socket.create_server(("127.0.0.1", 0))
    (folder / "port.tmp").write_text(str(server.getsockname()[1]))
    (folder / "port.tmp").rename(folder / "port")
    print("rank 0 trains", flush=True)
    peer, _ = server.accept()
    peer.settimeout(60)
    while peer.recv(4096):
        pass
    sys.stderr.write({GLOO_TERMINATE!r})
    sys.stderr.flush()
    os.abort()
deadline = time.monotonic() + 60
while not (folder / "port").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
connection = socket.create_connection(("127.0.0.1", int((folder / "port").read_text())))
connection.sendall(b"half")
time.sleep(0.3)  # rank 0's line before the fault is written as it came
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_lost_rank_is_the_root_cause_and_the_others_noise_its_consequence(
    tmp_path, capfd
):
    folder = tmp_path / "state"
    folder.mkdir()
    script = write_script(tmp_path, LOST_PEER)

    exit_code, out, err = run_cli(["--nproc-per-node", "2", script, str(folder)], capfd)

    assert exit_code == 128 + signal.SIGKILL
    # What rank 0 printed before the fault came as it was printed.
    assert "[rank 0] rank 0 trains" in out.splitlines()
    lines = err.splitlines()
    header = lines.index(
        "keras-dist: rank 0 printed what follows after rank 1 failed: a "
        "consequence of that failure, which the last line names"
    )
    # gloo's text comes after the label, none before it, and the launcher's
    # summary, which names the lost rank as the root cause, comes last.
    noise = [i for i, line in enumerate(lines) if "gloo" in line or "mismatch" in line]
    assert noise and min(noise) > header, err
    assert lines[-1] == (
        "keras-dist: rank 1 was killed by signal SIGKILL: the root cause; rank 0 "
        'failed after it, as a consequence (the collective errors above, "Is '
        'there a distributed collective mismatch in your code?", come from losing '
        "rank 1 in the middle of a collective, not from a mismatch or a bug in "
        "your code); stopped the other 0 process(es)"
    ), err
