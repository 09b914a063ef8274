"""Real multi-process PyTorch jobs: 2 gloo processes on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.multiprocess import (
    WORKERS,
    assert_each_sample_once_per_epoch,
    assert_own_data_parity,
    log_of,
    run_job,
)

pytestmark = pytest.mark.backend("torch")

TORCH = {"KERAS_BACKEND": "torch"}


@pytest.mark.parametrize(
    "kind", ["numpy", "tf_data", "py_dataset", "torch_loader", "generator"]
)
def test_every_sample_once_per_epoch_across_processes(kind, tmp_path):
    results = run_job(
        "torch_worker.py", [kind], processes=2, env=TORCH, output_dir=tmp_path
    )
    assert_each_sample_once_per_epoch(results, 37)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("torch_two")
    results = run_job(
        "torch_worker.py", ["train"], processes=2, env=TORCH, output_dir=output_dir
    )
    return results, output_dir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("torch_one")
    (result,) = run_job(
        "torch_worker.py", ["train"], processes=1, env=TORCH, output_dir=output_dir
    )
    return result


def test_ddp_training_matches_one_process(two_processes, one_process):
    """Ranks started from different seeds; 45 samples in batches of 12."""
    results, _ = two_processes
    assert [r["processes"] for r in results] == [2, 2]
    for result in results:
        for ours, reference in zip(
            result["weights"], one_process["weights"], strict=True
        ):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)


def test_logs_are_global_and_identical_on_every_rank(two_processes, one_process):
    results, _ = two_processes
    for result in results:
        for key, values in one_process["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        for key, value in one_process["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, atol=1e-5)
    assert results[0]["history"] == results[1]["history"]


def test_predict_returns_every_row_in_order_on_every_rank(two_processes, one_process):
    results, _ = two_processes
    for result in results:
        assert len(result["predictions"]) == 45
        np.testing.assert_allclose(
            result["predictions"], one_process["predictions"], atol=1e-5
        )


def test_only_rank_zero_prints(two_processes):
    _, output_dir = two_processes
    assert "loss" in log_of(output_dir, 0)
    assert "loss" not in log_of(output_dir, 1)


def test_batch_norm_statistics_stay_equal_on_every_rank(tmp_path):
    results = run_job(
        "torch_worker.py",
        ["train_batch_norm"],
        processes=2,
        env=TORCH,
        output_dir=tmp_path,
    )
    for first, second in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_allclose(first, second, atol=1e-6, rtol=0)
    assert len(results[0]["weights"]) == 8  # includes the moving mean and variance


def test_unused_weights_are_named(tmp_path):
    results = run_job(
        "torch_worker.py",
        ["unused_weight"],
        processes=2,
        env=TORCH,
        output_dir=tmp_path,
    )
    for result in results:
        assert result["error"] is not None
        assert "unused/kernel" in result["error"] and "used/kernel" not in result[
            "error"
        ].replace("unused/kernel", "")


def test_processes_feeding_their_own_data_train_like_one_process(tmp_path):
    """auto_shard_dataset=False with 19 and 18 samples per rank."""
    results = run_job(
        "torch_worker.py",
        ["own_data"],
        processes=2,
        env=TORCH,
        output_dir=tmp_path / "two",
    )
    (reference,) = run_job(
        "torch_worker.py",
        ["own_data_reference"],
        processes=1,
        env=TORCH,
        output_dir=tmp_path / "one",
    )
    assert_own_data_parity(results, reference)


def test_launcher_ends_the_job_when_a_rank_dies_mid_epoch(tmp_path):
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist",
            "launch",
            "--nproc-per-node",
            "2",
            str(WORKERS / "torch_worker.py"),
            "lose_a_process",
            str(tmp_path / "result.json"),
        ],
        env={**TORCH_ENV(), "KERAS_BACKEND": "torch"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    assert "rank 1 exited with code 17" in result.stderr


def TORCH_ENV() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
