"""Real multi-process JAX jobs: 2 processes x 2 CPU devices, gloo, loopback."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_dist.cluster import find_free_port
from tests.multiprocess import (
    assert_each_input_type_once_per_epoch,
    assert_own_data_parity,
    log_of,
    once_per_run,
    run_job,
    run_job_once,
)

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.backend("jax")

TWO_BY_TWO = {"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "2"}
ONE_BY_FOUR = {"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "4"}


# The 2-process runs of this module's tests in one job (each start-up costs
# seconds: CI's time): every input type first, while the processes are still
# unseeded (process 0's random streams must win), then the training, the
# own-data run, and last the different data, which ends in an error.
JOB = "every_kind,train,own_data,different_data"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job_once(
        tmp_path_factory,
        "jax_two_processes",
        "jax_worker.py",
        [JOB],
        processes=2,
        env=TWO_BY_TWO,
    )


def test_every_sample_once_per_epoch_across_processes(job):
    """Arrays, tf.data, a PyDataset, a DataLoader and a generator."""
    results = [result["every_kind"] for result in job[0]]
    assert_each_input_type_once_per_epoch(results, 37)
    # Shuffled arrays: a new global permutation each epoch.
    numpy_ids = results[0]["ids_by_kind"]["numpy"]
    assert numpy_ids[0] != numpy_ids[1]


@pytest.fixture(scope="module")
def two_process_training(job):
    results, output_dir = job
    return [dict(r["train"], own_data=r["own_data"]) for r in results], output_dir


@pytest.fixture(scope="module")
def one_process_training(tmp_path_factory):
    (result,) = once_per_run(
        tmp_path_factory,
        "jax_one_process",
        lambda directory: run_job(
            "jax_worker.py",
            ["train,own_data_reference"],
            processes=1,
            env=ONE_BY_FOUR,
            output_dir=directory,
        ),
    )
    return dict(result["train"], own_data_reference=result["own_data_reference"])


def test_two_by_two_training_matches_one_process_four_devices(
    two_process_training, one_process_training
):
    results, _ = two_process_training
    assert [r["processes"] for r in results] == [2, 2]
    assert [r["devices"] for r in results] == [4, 4]
    assert one_process_training["devices"] == 4
    for result in results:
        for ours, reference in zip(
            result["weights"], one_process_training["weights"], strict=True
        ):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)


def test_logs_hold_global_metrics_identical_on_every_process(
    two_process_training, one_process_training
):
    results, _ = two_process_training
    reference = one_process_training["history"]
    assert set(reference) == {"loss", "accuracy", "auc", "mse"}
    for result in results:
        for key, values in reference.items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
    assert results[0]["history"] == results[1]["history"]


def test_predict_returns_every_row_in_order_on_every_process(
    two_process_training, one_process_training
):
    results, _ = two_process_training
    for result in results:
        assert len(result["predictions"]) == 45
        np.testing.assert_allclose(
            result["predictions"], one_process_training["predictions"], atol=1e-5
        )


def test_only_process_zero_prints_progress_and_writes_logs(two_process_training):
    _, output_dir = two_process_training
    assert "Epoch 3/3" in log_of(output_dir, 0)
    assert "Epoch 1/3" not in log_of(output_dir, 1)
    progress = re.compile(r"\bloss: \d")  # Keras' progress bar ("loss: 0.93")
    assert progress.search(log_of(output_dir, 0))
    assert not progress.search(log_of(output_dir, 1))
    # The CSVLogger each process was given wrote on process 0 only.
    assert len((output_dir / "epochs-0.csv").read_text().splitlines()) == 4
    assert not (output_dir / "epochs-1.csv").exists()
    assert (output_dir / "model-0.weights.h5").exists()
    assert not (output_dir / "model-1.weights.h5").exists()


def test_processes_feeding_their_own_data_train_like_one_process(
    two_process_training, one_process_training
):
    """auto_shard_dataset=False with 19 and 18 samples: the processes agree on
    every step, pad the short shares, and train on the global batches they form
    together."""
    results = [result["own_data"] for result in two_process_training[0]]
    assert_own_data_parity(results, one_process_training["own_data_reference"])


def test_processes_reading_different_data_fail_naming_them(job):
    results = [result["different_data"] for result in job[0]]
    for result in results:
        assert result["error"] is not None
        assert "Processes [1] read different input than process 0" in result["error"]


def test_a_lost_process_ends_the_others_with_an_error_naming_it(tmp_path):
    started = time.monotonic()
    survivor, lost = run_job(
        "jax_worker.py",
        ["lose_a_process"],
        processes=2,
        env={**TWO_BY_TWO, "KERAS_DIST_HEARTBEAT_TIMEOUT": "10"},
        output_dir=tmp_path,
        timeout=120,
        allow_failures=True,
    )
    elapsed = time.monotonic() - started
    assert lost["returncode"] == 17
    assert survivor["returncode"] != 0, "the survivor must not finish training alone"
    assert elapsed < 90, f"the survivor took {elapsed:.0f}s to notice"
    assert "tasks are unhealthy" in survivor["log"]
    assert "stopped sending heartbeats):\n1\n" in survivor["log"]


def _launch(args: list[str], env: dict[str, str], cwd) -> subprocess.Popen:
    child_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")},
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "keras_dist", "launch", *args],
        env=child_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate(timeout=30)
        message = f"launcher still running after {timeout}s:\n{err[-3000:]}"
        raise AssertionError(message) from None
    return process.returncode, out, err


# The launcher ending a job whose rank dies mid-fit, on JAX: test_fault_lifecycle.py
# (kill -9 of a rank at a random moment of `fit`, a rank raising).


def test_multi_host_example_on_two_loopback_hosts(tmp_path):
    port = str(find_free_port())
    example = str(EXAMPLES / "multi_host" / "train.py")
    hosts = [
        _launch(
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--nproc-per-node",
                "1",
                example,
                "--epochs",
                "2",
                "--log",
                str(tmp_path / f"host{rank}.csv"),
            ],
            TWO_BY_TWO,
            tmp_path,
        )
        for rank in (1, 0)
    ]
    results = [_finish(host, timeout=240) for host in hosts]
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    checksums = [out.rsplit("weight checksum", 1)[1].strip() for _, out, _ in results]
    assert checksums[0] == checksums[1]
    assert (tmp_path / "host0.csv").exists()
    assert not (tmp_path / "host1.csv").exists()
