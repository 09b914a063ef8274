"""Real multi-worker TensorFlow jobs: 2 processes on loopback (TF_CONFIG)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.multiprocess import (
    assert_each_sample_once_per_epoch,
    log_of,
    once_per_run,
    run_job,
    run_job_once,
)

pytestmark = pytest.mark.backend("tensorflow")

TF = {"KERAS_BACKEND": "tensorflow"}


# The 2-worker runs of this module's tests in one job (each start-up costs
# seconds: CI's time): the shuffled ids first, then the training, and last the
# different data, which ends in an error.
JOB = "ids,train,different_data"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job_once(
        tmp_path_factory, "tf_two", "tf_worker.py", [JOB], processes=2, env=TF
    )


@pytest.fixture(scope="module")
def two_workers(job):
    results, output_dir = job
    return [result["train"] for result in results], output_dir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    (result,) = once_per_run(
        tmp_path_factory,
        "tf_one",
        lambda directory: run_job(
            "tf_worker.py", ["train"], processes=1, env=TF, output_dir=directory
        ),
    )
    return result


def test_two_workers_train_like_one_process(two_workers, one_process):
    """Ranks started from different seeds and built the model outside the
    scope; 45 weighted samples in batches of 12 (the last one padded); two
    BatchNormalization layers normalize over both workers' real rows."""
    results, _ = two_workers
    assert [r["processes"] for r in results] == [2, 2]
    assert [r["devices"] for r in results] == [["cpu:0", "cpu:1"]] * 2
    for result in results:
        for ours, reference in zip(
            result["weights"], one_process["weights"], strict=True
        ):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)


def test_logs_are_global_and_identical_on_every_worker(two_workers, one_process):
    results, _ = two_workers
    for result in results:
        assert result["history"].keys() == one_process["history"].keys()
        for key, values in one_process["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        for key, value in one_process["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, atol=1e-5)
    assert results[0]["history"] == results[1]["history"]


def test_predict_returns_every_row_in_order_on_every_worker(two_workers, one_process):
    results, _ = two_workers
    for result in results:
        assert len(result["predictions"]) == 45
        np.testing.assert_allclose(
            result["predictions"], one_process["predictions"], atol=1e-5
        )


def test_only_worker_zero_prints(two_workers):
    _, output_dir = two_workers
    assert "loss" in log_of(output_dir, 0)
    assert "loss" not in log_of(output_dir, 1)


def test_shuffled_arrays_give_each_sample_to_one_worker_per_epoch(job):
    results = [result["ids"] for result in job[0]]
    assert_each_sample_once_per_epoch(results, 37)
    # Reshuffled each epoch exactly when plain Keras of this release
    # reshuffles (3.15 does; 3.16 draws one order, fixed when its dataset is
    # built), and every worker drew the same order.
    reshuffles = results[0]["keras_reshuffles"]
    assert results[1]["keras_reshuffles"] == reshuffles
    assert (results[0]["ids"][0] != results[0]["ids"][1]) == reshuffles


def test_workers_reading_different_data_fail_naming_them(job):
    for result in [result["different_data"] for result in job[0]]:
        assert result["error"] is not None
        assert "Processes [1] read different input than process 0" in result["error"]


def test_keras_multi_worker_bugs_and_their_workarounds(tmp_path):
    """keras-team/keras#20585, reproduced with Keras alone: when this fails
    because Keras fixed a bug, drop that workaround from
    backends/tensorflow/keras_internals.py."""
    results = run_job(
        "tf_worker.py", ["keras_20585"], processes=2, env=TF, output_dir=tmp_path
    )
    for result in results:
        errors = result["errors"]
        # The symbolic build averages a nested per-replica batch across workers.
        assert "PerReplica" in errors["keras"], errors["keras"]
        # Scalar logs are reduced along axis 0.
        assert "Invalid reduction dimension 0" in errors["build_fixed"], errors
        assert errors["both_fixed"] is None
    for first, second in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_allclose(first, second, atol=1e-6)


def test_a_lost_worker_ends_the_survivor_with_an_error(tmp_path):
    started = time.monotonic()
    survivor, lost = run_job(
        "tf_worker.py",
        ["lose_a_process"],
        processes=2,
        env=TF,
        output_dir=tmp_path,
        timeout=150,
        allow_failures=True,
    )
    elapsed = time.monotonic() - started
    assert lost["returncode"] == 17
    assert survivor["returncode"] != 0, "the survivor must not finish training alone"
    assert elapsed < 120, f"the survivor took {elapsed:.0f}s to notice"
    assert "survivor error after" in survivor["log"]
