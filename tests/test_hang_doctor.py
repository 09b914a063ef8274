"""The hang doctor (issue 11): a rank that stops advancing is named, every rank
dumps its stacks, and the job ends; under `keras-dist launch --hang-timeout`
and, without it, through `KERAS_DIST_HANG_TIMEOUT` (torchrun, SLURM, Ray).

The launcher test runs on the backend of the suite (`KERAS_BACKEND`), the test
without the launcher on PyTorch: rank 1 sleeps in a callback after its third
step (tests/workers/hang_worker.py).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import keras
import pytest

import keras_dist as kd
from keras_dist import cli
from keras_dist.cluster import hang_doctor, launcher
from keras_dist.faults import heartbeat
from tests.multiprocess import WORKERS, run_job

BACKEND = keras.backend.backend()
HANG_TIMEOUT = 4
# The target is the hang timeout plus 10 s; 2 busy cores get twice that.
ENDS_WITHIN = HANG_TIMEOUT + 20
REPOSITORY = pathlib.Path(__file__).parent.parent


def job_environment(**extra: str) -> dict[str, str]:
    """This process' environment for the ranks, without its keras_dist
    settings (8 simulated devices and the like)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers; it runs nothing.
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def assert_none_left(state: pathlib.Path) -> None:
    pids = [int(path.read_text()) for path in state.glob("pid-*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(map(is_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(is_alive, pids)), f"left running: {pids}"


def assert_stacks_dumped(output: str, rank_prefix: str = "") -> None:
    for rank in (0, 1):
        prefix = rank_prefix.format(rank=rank)
        assert f"{prefix}keras-dist: hang doctor: rank {rank}: fit (call 1)" in output
        assert f"hang doctor: rank {rank}: Python stacks of every thread" in output
        assert f"hang doctor: rank {rank}: collective trace: " in output
    # Rank 1's main thread sleeps in the worker's callback.
    assert "in sleep_in_callback" in output
    if BACKEND == "torch":
        assert "collective trace: torch Flight Recorder" in output
        assert "gloo:all_reduce" in output
    else:
        assert "this backend keeps no trace of its collectives" in output


def test_launch_hang_timeout_names_the_sleeping_rank_and_ends_the_job(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        "--nproc-per-node",
        "2",
        "--hang-timeout",
        str(HANG_TIMEOUT),
        str(WORKERS / "hang_worker.py"),
        str(state),
    ]
    with (tmp_path / "err").open("wb") as err:
        process = subprocess.Popen(
            command,
            env=job_environment(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPOSITORY,
            start_new_session=True,
        )
        try:
            exit_code = process.wait(timeout=180)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait(timeout=10)
    ended = time.time()
    output = (tmp_path / "err").read_text()

    assert exit_code == hang_doctor.HANG_EXIT_CODE, output[-3000:]
    hung_for = ended - float((state / "hang").read_text())
    print(f"{BACKEND}: hang -> job end {hung_for:.1f} s (hang timeout {HANG_TIMEOUT})")
    assert hung_for < ENDS_WITHIN, output[-3000:]
    summaries = [line for line in output.splitlines() if "hang detected" in line]
    assert len(summaries) == 1, output[-3000:]
    assert summaries[0].startswith("keras-dist: hang detected")
    assert summaries[0].endswith("rank behind: 1")
    assert "  behind:  rank 1: fit (call 1), epoch 0, step 3, phase 'callback'" in (
        output
    )
    assert_stacks_dumped(output, rank_prefix="[rank {rank}] ")
    assert_none_left(state)


# torchrun's case; the watchdog is the same code on every backend (the launcher
# test covers each backend's dumps), and the suite's time is short.
@pytest.mark.backend("torch")
def test_hang_timeout_variable_ends_a_job_started_without_the_launcher(tmp_path):
    state = tmp_path / "state"
    state.mkdir()

    temporary = tmp_path / "tmp"
    temporary.mkdir()

    results = run_job(
        "hang_worker.py",
        [str(state)],
        processes=2,
        env=job_environment(
            KERAS_DIST_HANG_TIMEOUT=str(HANG_TIMEOUT), TMPDIR=str(temporary)
        ),
        output_dir=tmp_path / "job",
        timeout=180,
        allow_failures=True,
    )
    ended = time.time()

    assert [r["returncode"] for r in results] == [hang_doctor.HANG_EXIT_CODE] * 2, (
        results[0]["log"][-3000:] + results[1]["log"][-3000:]
    )
    hung_for = ended - float((state / "hang").read_text())
    print(f"{BACKEND}: without launcher, hang -> job end {hung_for:.1f} s")
    assert hung_for < ENDS_WITHIN
    # The lowest rank prints the one summary; each rank dumps its own stacks.
    assert "keras-dist: hang detected" in results[0]["log"]
    assert "hang detected" not in results[1]["log"]
    assert (
        "  behind:  rank 1: fit (call 1), epoch 0, step 3, phase 'callback'"
        in (results[0]["log"])
    )
    assert_stacks_dumped(results[0]["log"] + results[1]["log"])
    assert_none_left(state)
    # The node's heartbeat directory went with the job.
    assert not list(temporary.glob("keras_dist_heartbeats_*"))


# -- options -------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["nan", "-1", "inf", "soon"])
def test_hang_timeout_variable_rejects_bad_values_naming_them(raw, monkeypatch):
    monkeypatch.setenv("KERAS_DIST_HANG_TIMEOUT", raw)

    with pytest.raises(ValueError, match=f"KERAS_DIST_HANG_TIMEOUT='{raw}'"):
        kd.initialize()


def test_hang_timeout_variable_defaults_to_1800_and_zero_turns_it_off():
    assert hang_doctor.hang_timeout_from_environment({}) == 1800
    assert (
        hang_doctor.hang_timeout_from_environment({"KERAS_DIST_HANG_TIMEOUT": "0"}) == 0
    )
    assert (
        hang_doctor.hang_timeout_from_environment({"KERAS_DIST_HANG_TIMEOUT": "2.5"})
        == 2.5
    )


@pytest.mark.parametrize(
    "value, error", [(-1, ValueError), (float("nan"), ValueError), ("5", TypeError)]
)
def test_initialize_rejects_a_bad_hang_timeout(value, error):
    with pytest.raises(error, match=f"hang_timeout={value!r}"):
        kd.initialize(hang_timeout=value)


@pytest.mark.parametrize(
    "value, error",
    [
        (-0.5, ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("9", TypeError),
    ],
)
def test_launch_config_rejects_a_bad_hang_timeout(value, error, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("")

    with pytest.raises(error, match=f"hang_timeout={value!r}"):
        launcher.LaunchConfig(str(script), hang_timeout=value)


def test_launcher_passes_the_hang_timeout_to_every_rank(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("")
    config = launcher.LaunchConfig(str(script), nproc_per_node=2, hang_timeout=7)
    unset = launcher.LaunchConfig(str(script), nproc_per_node=2)
    base = {"KERAS_DIST_HANG_TIMEOUT": "30"}

    env = launcher.rank_environment(config, 1, "127.0.0.1:1234", base=base)
    kept = launcher.rank_environment(unset, 1, "127.0.0.1:1234", base=base)

    assert env["KERAS_DIST_HANG_TIMEOUT"] == "7.0"
    assert kept["KERAS_DIST_HANG_TIMEOUT"] == "30"


def test_cli_rejects_a_bad_hang_timeout_with_a_usage_error(tmp_path, capfd):
    script = tmp_path / "script.py"
    script.write_text("")

    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            ["launch", "--nproc-per-node", "1", "--hang-timeout", "nan", str(script)]
        )

    assert exit_info.value.code == 2
    assert "Received: --hang-timeout nan" in capfd.readouterr().err


# -- who is behind -------------------------------------------------------------
def beat(rank, progress, phase, idle=10.0, timeout=5.0):
    return {
        "rank": rank,
        "mode": "fit",
        "call": 1,
        "epoch": 0,
        "step": progress // 2,
        "phase": phase,
        "progress": progress,
        "advanced_at": 100.0 - idle,
        "hang_timeout": timeout,
    }


def test_the_rank_with_least_progress_is_behind():
    beats = [beat(0, 9, "step"), beat(1, 7, "step"), beat(2, 9, "callback")]

    assert [b["rank"] for b in hang_doctor.ranks_behind(beats)] == [1]


def test_among_equals_a_rank_in_its_own_code_is_behind_a_waiting_one():
    beats = [beat(0, 7, "step"), beat(1, 7, "data"), beat(2, 7, "callback")]

    assert [b["rank"] for b in hang_doctor.ranks_behind(beats)] == [2]
    assert [b["rank"] for b in hang_doctor.ranks_behind(beats[:2])] == [1]
    assert [b["rank"] for b in hang_doctor.ranks_behind(beats[:1])] == [0]


def test_only_monitored_ranks_past_their_timeout_have_stalled():
    beats = [
        beat(0, 7, "step", idle=4.0),
        beat(1, 7, "outside", idle=60.0),
        beat(2, 7, "save", idle=6.0),
        beat(3, 7, "callback", idle=60.0, timeout=0.0),
    ]

    assert [b["rank"] for b in hang_doctor.stalled(beats, now=100.0)] == [2]


def test_the_summary_says_when_every_rank_seen_waits_in_a_step():
    beats = [beat(2, 7, "step"), beat(3, 7, "step")]

    report = hang_doctor.summary(beats, now=100.0, world_size=4)

    assert report.splitlines()[0].endswith("ranks behind: 2, 3")
    assert "heartbeats of 2 of 4 ranks seen" in report
    assert "the rank behind may be on another node" in report


def test_a_watched_step_marks_progress_and_stays_one_object_per_step():
    """The heartbeat's per-step work is a wrapper and a few attribute writes
    (its cost is measured in the session note, not asserted here); a step
    Keras reuses keeps one wrapper, so Keras' own reuse of compiled steps
    across calls is unchanged."""
    calls = []

    def step(batch):
        calls.append(batch)
        assert heartbeat._beat.phase == "step"
        return batch * 2

    watched = heartbeat._watched_step(step)
    assert heartbeat._watched_step(step) is watched
    beat = heartbeat._beat
    saved = beat.snapshot()
    try:
        assert watched(21) == 42
        assert calls == [21]
        assert (beat.step, beat.progress) == (saved[3] + 1, saved[5] + 2)
        assert beat.phase == "callback"
    finally:
        beat.step, beat.phase, beat.progress = saved[3], saved[4], saved[5]


def test_heartbeats_of_ranks_killed_outright_are_removed_at_the_next_start(
    tmp_path, monkeypatch
):
    """A rank killed by SIGKILL (no launcher) cannot remove its heartbeat; the
    next job's ranks on the node do, and leave live ranks' heartbeats alone."""
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=60)
    dead = tmp_path / "keras_dist_heartbeats_127.0.0.1_1-"
    live = tmp_path / "keras_dist_heartbeats_127.0.0.1_2-"
    for directory, pid in ((dead, finished.pid), (live, os.getpid())):
        directory.mkdir()
        hang_doctor.write_heartbeat(
            str(directory / "rank-1.heartbeat.json"), {"rank": 1, "pid": pid}
        )
    monkeypatch.setattr(heartbeat, "_NODE_TEMPORARY_DIRECTORY", str(tmp_path))
    heartbeat._remove_stale_node_directories()
    assert not dead.exists()
    assert (live / "rank-1.heartbeat.json").exists()
