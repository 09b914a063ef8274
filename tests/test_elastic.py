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
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_dist.checkpoint import store
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
    assert (
        "rank 2 lost" in changes[0]
        and "going on with 2 process(es) of 3" in (changes[0])
    ), changes[0]
    result = json.loads((tmp_path / "result-0.json").read_text())
    model, history = fit_in_this_process(tmp_path / "reference")
    weights = model.get_weights()
    epochs = {
        epoch: {name: values[epoch] for name, values in history.history.items()}
        for epoch in range(EPOCHS)
    }
    for ours, theirs in zip(result["weights"], weights, strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=0)
    logged = {}
    for line in (tmp_path / "epochs.jsonl").read_text().splitlines():
        entry = json.loads(line)
        logged[entry.pop("epoch")] = entry  # the last attempt's line wins
    assert sorted(logged) == list(range(EPOCHS))
    for epoch, values in epochs.items():
        assert logged[epoch] == pytest.approx(values, abs=1e-5), epoch
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
