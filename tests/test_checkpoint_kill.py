"""A rank killed mid-fit never costs a checkpoint (issue 11, item 3).

`keras-dist launch` runs 2 ranks that checkpoint every 2 steps
(`ModelCheckpoint("ck/ckpt.keras", save_freq=2)` and a `.weights.h5` one);
the test sends `kill -9` to rank 1 from outside at a random moment, in 2 jobs.
Every time the job ends within a bound, no process is left, each checkpoint is
absent (killed before the first save) or complete and loads in plain Keras, a
checkpoint that was there before is still there, and no temporary file of
keras_dist's is left next to it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_dist.training import saving
from tests.conftest import BACKEND
from tests.multiprocess import WORKERS

# Generous: the target is 10 s from the kill to the end of the job.
JOB_END_BOUND_SECONDS = 30.0


def _launch(checkpoints, state) -> subprocess.Popen:
    """`keras-dist launch` of 2 ranks; its messages go to `state/launcher.txt`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env["KERAS_BACKEND"] = BACKEND
    if BACKEND != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    worker = str(WORKERS / "checkpoint_kill_worker.py")
    with open(state / "launcher.txt", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "2"]
            + [worker, str(checkpoints), str(state)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )


def _left_running(groups: list[int]) -> list[int]:
    """The live (not zombie) processes of the process groups `groups`."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                state, _, group = handle.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if state != "Z" and int(group) in groups:
            left.append(int(entry))
    return left


def _plain_model() -> keras.Model:
    from tests.workers.checkpoint_kill_worker import build  # noqa: PLC0415

    return build()


def _assert_complete(checkpoints) -> None:
    """Every checkpoint there loads in plain Keras, into the right model."""
    expected = [w.shape for w in _plain_model().get_weights()]
    if (checkpoints / "ckpt.keras").exists():
        loaded = keras.saving.load_model(checkpoints / "ckpt.keras")
        assert [w.shape for w in loaded.get_weights()] == expected
        assert all(np.isfinite(w).all() for w in loaded.get_weights())
    if (checkpoints / "ckpt.weights.h5").exists():
        plain = _plain_model()
        plain.load_weights(checkpoints / "ckpt.weights.h5")


def _seed_checkpoints(checkpoints) -> None:
    """A previous good checkpoint (from plain Keras) that must never be lost."""
    net = _plain_model()
    net.save(checkpoints / "ckpt.keras")
    net.save_weights(checkpoints / "ckpt.weights.h5")


# The one-writer protocol (process 0 writes a temporary file, renames it when
# complete) is the same code on every backend; measured on all three when
# written (see the README), run on one for CI's time.
@pytest.mark.backend("jax")
def test_kill_9_of_a_rank_mid_fit_never_costs_a_checkpoint(tmp_path):
    """2 jobs at once (one has no checkpoint yet, one has a previous good one),
    each killed at its own random moment once all of them train."""
    seed = random.randrange(1 << 30)
    moments = random.Random(seed).sample([0.1 * i for i in range(1, 31)], 2)
    runs = []
    for run in range(2):
        checkpoints, state = tmp_path / f"ck-{run}", tmp_path / f"state-{run}"
        checkpoints.mkdir()
        state.mkdir()
        if run:
            _seed_checkpoints(checkpoints)
        there_before = sorted(p.name for p in checkpoints.iterdir())
        runs.append((checkpoints, state, there_before, _launch(checkpoints, state)))
    try:
        # Once every job trains (no job starting up slows the others' ends).
        deadline = time.monotonic() + 180
        pids = {}
        while len(pids) < len(runs):
            for run, (_, state, _, launcher) in enumerate(runs):
                found = _pids_if_training(state, launcher)
                if found is not None:
                    pids[run] = found
            assert time.monotonic() < deadline, "the ranks never trained"
            time.sleep(0.02)
        started = time.monotonic()
        killed = {}
        for run in sorted(pids, key=lambda run: moments[run]):
            time.sleep(max(0.0, started + moments[run] - time.monotonic()))
            os.kill(pids[run][1], signal.SIGKILL)
            killed[run] = (time.monotonic(), pids[run])
        ended = {}
        while len(ended) < len(runs) and time.monotonic() < deadline:
            for run, (*_, launcher) in enumerate(runs):
                if run not in ended and launcher.poll() is not None:
                    ended[run] = time.monotonic()
            time.sleep(0.02)
        for run, (checkpoints, state, there_before, launcher) in enumerate(runs):
            killed_at, pids = killed[run]
            took = ended.get(run, float("inf")) - killed_at
            err = (state / "launcher.txt").read_text()
            context = f"run {run} (seed {seed}, kill at {moments[run]:.1f} s)"
            _check_run(context, took, launcher.returncode, err, pids)
            names = sorted(p.name for p in checkpoints.iterdir())
            assert not [n for n in names if n.startswith(".keras_dist-")], context
            assert set(there_before) <= set(names), f"{context}: {names}"
            _assert_complete(checkpoints)
    finally:
        for *_, launcher in runs:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)


def _pids_if_training(state, launcher) -> list[int] | None:
    paths = [state / f"pid-{rank}" for rank in (0, 1)]
    if all(path.exists() for path in paths):
        return [int(path.read_text()) for path in paths]
    if launcher.poll() is not None:
        err = (state / "launcher.txt").read_text()
        raise AssertionError(f"the job ended before training:\n{err[-3000:]}")
    return None


def _check_run(context: str, took: float, code: int, err: str, pids) -> None:
    """The job failed, said which rank, ended in time and left no rank."""
    print(f"{context}: the job ended {took:.1f} s after the kill")
    summary = [line for line in err.splitlines() if line.startswith("keras-dist:")]
    print(f"{context}: {summary[-1] if summary else err[-3000:]}")
    assert code != 0, context
    assert summary and "rank " in summary[-1], f"{context}:\n{err[-3000:]}"
    assert took < JOB_END_BOUND_SECONDS, f"{context}: {took:.1f} s\n{err[-3000:]}"
    # No process left: the ranks and whatever they started (each rank leads
    # its process group) are gone.
    left = _left_running(pids)
    assert not left, f"{context}: processes still running: {left}"


def test_a_save_removes_the_temporary_files_of_killed_writers(tmp_path):
    """A writer killed outright (SIGKILL) cannot remove its temporary file:
    the next save next to it does, and keeps those of running processes."""
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=30)
    stale = tmp_path / f".keras_dist-{finished.pid}-ckpt.keras"
    stale.write_bytes(b"half a fi")
    running = tmp_path / f".keras_dist-{os.getppid()}-ckpt.keras"
    running.write_bytes(b"being written")
    target = tmp_path / "ckpt.keras"

    def save(model, filepath, overwrite=True):
        with open(filepath, "wb") as handle:
            handle.write(b"complete")

    saving._write_whole(save, None, str(target), {}, (), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, target.name]
    assert target.read_bytes() == b"complete"
