"""Jobs that survive: `kd.Checkpoint` across real processes (issue 12).

- A 2-process job under `keras-dist launch --max-restarts 2` loses a rank to
  `kill -9` at a random step (during a background save or between saves),
  restarts, is preempted by a SIGTERM to rank 0 (every rank saves at one
  agreed step and exits 75), restarts again and ends with the weights and the
  per-epoch logs of an uninterrupted job (Dropout, BatchNormalization, Adam,
  `shuffle=True`, 45 rows in batches of 8).
- World size: a checkpoint written by 1 process resumes in 2, and one written
  by 2 resumes in 1 (JAX, TensorFlow: 8 devices in one process, 2 x 2 devices
  in two), ending as the uninterrupted run (no Dropout: its masks depend on
  how the batch is split).
- SIGTERM to `keras-dist launch` (PyTorch: the same code on every backend):
  every rank saves at one step within `--grace-period`; SIGUSR1 to a lone
  process saves and exits 75.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store
from tests.conftest import BACKEND
from tests.multiprocess import WORKERS, run_job
from tests.test_launcher import wait_until
from tests.workers.checkpoint_resume_worker import EPOCHS, fit_in_this_process

WORKER = "checkpoint_resume_worker.py"


def _environment(**extra: str) -> dict[str, str]:
    env = {"KERAS_BACKEND": BACKEND, **extra}
    if BACKEND != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    return env


def _weights(result: dict) -> list[np.ndarray]:
    return [np.asarray(w, "float32") for w in result["weights"]]


def _assert_close(got: list, expected: list, atol: float) -> None:
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)


def _epoch_logs(state) -> dict[int, dict]:
    """The last line logged for each epoch (a restarted attempt logs again)."""
    logs = {}
    for line in (state / "epochs.jsonl").read_text().splitlines():
        entry = json.loads(line)
        logs[entry.pop("epoch")] = entry
    return logs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    state = tmp_path_factory.mktemp("uninterrupted")
    results = run_job(
        WORKER,
        [str(state / "ck"), str(state)],
        processes=2,
        env=_environment(),
        output_dir=state,
        timeout=240,
    )
    return {
        "weights": _weights(results[0]),
        "epochs": _epoch_logs(state),
        "directory": state / "ck",
    }


# The launcher, kd.Checkpoint's commit protocol and the preemption agreement are
# the same code on every backend, and each backend's engine resumes in
# test_checkpoint_kill.py / test_checkpoint_<backend>.py: one backend here,
# for CI time.
@pytest.mark.backend("jax")
def test_a_killed_then_preempted_job_ends_as_an_uninterrupted_one(
    uninterrupted, tmp_path
):
    # A random kill point: an even step is killed while its background save
    # is being written, an odd one between saves. The preemption comes in
    # the next attempt.
    kill_at = random.Random().randint(3, 11)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(
        _environment(FAULTS=f"KILL@{kill_at}@1,TERM@11@0", KERAS_DIST_INIT_TIMEOUT="60")
    )
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        str(WORKERS / WORKER),
        str(tmp_path / "ck"),
        str(tmp_path),
    ]
    launched = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=400
    )
    log = launched.stderr
    said = [line for line in log.splitlines() if "keras-dist" in line or "kd." in line]
    context = f"kill at step {kill_at}\n" + "\n".join(said[-40:])

    assert launched.returncode == 0, context
    assert "rank 1 was killed by signal SIGKILL" in log, context
    # Rank 0 signals itself after step 11 (the first attempt resumed from 10
    # at the latest); the ranks agree on a step a few steps later.
    preempted = re.search(r"preempted \(SIGTERM\): saved step (\d+)", log)
    assert preempted, context
    step = int(preempted.group(1))
    assert 12 < step < 18, context
    assert log.count("exiting with status 75") == 2, context  # both ranks
    assert "restart 2 of 2" in log, context
    assert f"(step {step}: epoch 2, batch {step - 12})" in log, context
    result = json.loads((tmp_path / "result-0.json").read_text())
    _assert_close(_weights(result), uninterrupted["weights"], atol=1e-6)
    epochs = _epoch_logs(tmp_path)
    assert sorted(epochs) == list(range(EPOCHS))
    for epoch, logs in uninterrupted["epochs"].items():
        assert epochs[epoch] == pytest.approx(logs, abs=1e-6), (epoch, context)
    assert not os.path.exists(tmp_path / "ck" / ".keras_dist-preemption.json")


def _fit_here(directory, kind: str = "arrays") -> list[np.ndarray]:
    """The worker's fit (no Dropout) in this process: 1 process, all its
    devices."""
    model, _ = fit_in_this_process(directory, kind)
    return model.get_weights()


def _copy_until(source, target, last_step: int) -> None:
    """A checkpoint directory holding `source`'s steps up to `last_step`."""
    target.mkdir()
    for step in store.complete_steps(str(source)):
        if step <= last_step:
            shutil.copytree(
                store.step_directory(str(source), step),
                store.step_directory(str(target), step),
            )


# TensorFlow (its multi-worker shuffle) and PyTorch here; JAX restores across
# process counts in test_checkpoint_jax.py, and this passed on JAX when written
# (left out there for CI's time).
# A shuffled PyDataset (Keras' order through Python's `random`) on TensorFlow
# only: JAX and PyTorch share the generators the same way for every input. The
# job fits once for each kind (one job: CI's time).
RESUMED_KINDS = {"tensorflow": ["arrays", "py_dataset"], "torch": ["arrays"]}


@pytest.mark.backend("tensorflow", "torch")
def test_a_checkpoint_resumes_on_another_number_of_processes(tmp_path):
    """Shuffled (seeded) data: the global batches are a function of the seed
    and the epoch only, so the order continues exactly on another count."""
    kinds = RESUMED_KINDS[BACKEND]
    for place in ("one", "two", "back"):
        (tmp_path / place).mkdir()
    one = {kind: _fit_here(tmp_path / "one" / kind, kind) for kind in kinds}

    # 1 process -> 2: resume mid-epoch 1 (step 8) in a 2-process job.
    for kind in kinds:
        _copy_until(tmp_path / "one" / kind, tmp_path / "two" / kind, 8)
    directory = tmp_path / "two" / kinds[0] if len(kinds) == 1 else tmp_path / "two"
    results = run_job(
        WORKER,
        [str(directory), str(tmp_path)],
        processes=2,
        env=_environment(DROPOUT="0", INPUT=",".join(kinds)),
        output_dir=tmp_path / "job",
        timeout=240,
    )
    log = (tmp_path / "job" / "log-0.txt").read_text()
    assert log.count("resuming from") == len(kinds), log[-3000:]
    for kind in kinds:
        result = results[0] if len(kinds) == 1 else results[0][kind]
        _assert_close(_weights(result), one[kind], atol=1e-5)

        # 2 processes -> 1: resume mid-epoch 2 (step 14, written by the job).
        manifest = json.loads(
            (tmp_path / "two" / kind / "step-000000014" / store.MANIFEST).read_text()
        )
        assert manifest["world"]["processes"] == 2
        _copy_until(tmp_path / "two" / kind, tmp_path / "back" / kind, 14)
        _assert_close(_fit_here(tmp_path / "back" / kind, kind), one[kind], atol=1e-5)


# The launcher and the ranks' preemption path are the same code on every
# backend (each backend's preemption runs in the test above).
@pytest.mark.backend("torch")
def test_sigterm_to_the_launcher_saves_one_agreed_step_and_ends_the_job(tmp_path):
    """Preemption of the whole node: the launcher forwards SIGTERM, every rank
    saves at one step within `--grace-period`, the launcher exits 143; a new
    launch resumes from there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(_environment(STEP_SECONDS="0.3", KERAS_DIST_INIT_TIMEOUT="60"))
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "launch",
        "--nproc-per-node",
        "2",
        "--grace-period",
        "60",
        str(WORKERS / WORKER),
        str(tmp_path / "ck"),
        str(tmp_path),
    ]
    with open(tmp_path / "launcher.txt", "w") as log:
        launcher = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            started = wait_until(
                lambda: (
                    store.latest_step(str(tmp_path / "ck")) is not None
                    or launcher.poll() is not None
                ),
                timeout=180,
            )
            assert started and launcher.poll() is None
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    text = (tmp_path / "launcher.txt").read_text()
    said = "\n".join(line for line in text.splitlines() if "keras-dist" in line)

    assert launcher.returncode == 128 + signal.SIGTERM, said
    assert said.count("exiting with status 75") == 2, said
    step = store.latest_step(str(tmp_path / "ck"))
    assert f"saved step {step} into" in said, said
    assert step < EPOCHS * 6  # saved before the end, not after it

    # Resuming from it is what every other test here does.


@pytest.mark.backend("torch")
def test_sigusr1_to_a_lone_process_saves_and_exits_75(tmp_path):
    """`sbatch --signal=USR1@...` without the launcher: one process, Python's
    own signal handling (no multi-process lifecycle), the same promise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(_environment(STEP_SECONDS="0.3"))
    worker = subprocess.Popen(
        [sys.executable, str(WORKERS / WORKER), str(tmp_path / "ck"), str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started = wait_until(
            lambda: (
                store.latest_step(str(tmp_path / "ck")) is not None
                or worker.poll() is not None
            ),
            timeout=120,
        )
        assert started and worker.poll() is None
        worker.send_signal(signal.SIGUSR1)
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == kd.checkpoint.PREEMPTED_EXIT_CODE, err[-3000:]
    step = store.latest_step(str(tmp_path / "ck"))
    assert f"preempted (SIGUSR1): saved step {step} into" in err
    assert step < EPOCHS * 6
    assert not (tmp_path / "result-0.json").exists()  # it did not finish


def test_a_damaged_newest_checkpoint_is_named_and_both_ranks_resume_before_it(
    uninterrupted, tmp_path
):
    """The newest checkpoint (step 18, the end of the job) has its largest
    data file garbled (its size unchanged: only the engine finds it, as it
    reads): every rank passes it over, together, process 0 warns naming the
    step and the file, and the job trains steps 17 and 18 again, ending as the
    uninterrupted one."""
    directory = tmp_path / "ck"
    shutil.copytree(uninterrupted["directory"], directory)
    newest = directory / "step-000000018"
    manifest = json.loads((newest / store.MANIFEST).read_text())
    data = [
        name
        for name in manifest["files"]
        if name.startswith(("orbax/d/", "__", "ckpt.data-"))
    ]
    damaged = newest / max(data, key=manifest["files"].get)
    damaged.write_bytes(bytes(255 - b for b in damaged.read_bytes()))
    results = run_job(
        WORKER,
        [str(directory), str(tmp_path)],
        processes=2,
        env=_environment(),
        output_dir=tmp_path,
        timeout=240,
    )
    logs = [(tmp_path / f"log-{rank}.txt").read_text() for rank in (0, 1)]
    assert "1 damaged checkpoint(s) skipped, resuming from step 16 instead" in logs[0]
    assert str(damaged) in logs[0], logs[0][-3000:]
    assert f"resuming from {directory / 'step-000000016'}" in logs[0]
    # Process 0 reports. (Rank 1's log may hold the engine's own record of
    # the failed read, whose path names this test's directory: only
    # keras_dist's report is looked for.)
    assert "damaged checkpoint(s) skipped" not in logs[1], logs[1][-3000:]
    for result in results:
        _assert_close(_weights(result), uninterrupted["weights"], atol=1e-6)
    assert store.complete_steps(str(directory))[-1] == 18
