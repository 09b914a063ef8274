"""keras_dist's PyTorch paths on a CUDA GPU, each against plain Keras on it.

A job of one process (`keras-dist launch --nproc-per-node 1`), then 2
processes sharing the one GPU over gloo (`KERAS_DIST_TORCH_BACKEND=gloo`:
NCCL refuses two ranks on one GPU, which `kd.initialize()` says before the
job starts). The 2-process job runs keras_dist's multi-process CUDA code: the
`LOCAL_RANK` to device mapping and the gradient all-reduce on CUDA tensors
(a job of one process starts no process group, so it never syncs), and
equals the one process within 1e-5. Each job runs FSDP, bf16 mixed
precision, remat, the compiled step and a checkpoint's save and restore.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.gpu.conftest import cuda_present, needs_cuda

pytestmark = pytest.mark.backend("torch")

WORKER = pathlib.Path(__file__).parents[1] / "workers" / "torch_gpu_worker.py"
SCENARIOS = "dp,fsdp,bf16,remat,compiled,checkpoint"
TOLERANCE = 1e-5


def _launch(processes: int, scenarios: str, output: pathlib.Path) -> list[dict]:
    output.mkdir(parents=True, exist_ok=True)
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KERAS_DIST", "KERAS_DISTRIBUTION"))
    }
    environment.update(KERAS_BACKEND="torch", KERAS_DIST_TORCH_BACKEND="gloo")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_dist",
            "launch",
            "--nproc-per-node",
            str(processes),
            "--hang-timeout",
            "240",
            str(WORKER),
            str(output),
            scenarios,
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert completed.returncode == 0, (
        completed.stdout[-4000:] + "\n" + completed.stderr[-4000:]
    )
    return [
        json.loads((output / f"result-{rank}.json").read_text())
        for rank in range(processes)
    ]


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    (result,) = _launch(1, "plain," + SCENARIOS, tmp_path_factory.mktemp("one"))
    return result


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return _launch(2, SCENARIOS, tmp_path_factory.mktemp("two"))


def _gap(first: list[float], second: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(first) - np.asarray(second))))


def test_one_process_trains_on_the_gpu_as_plain_keras(one):
    assert one["processes"] == 1 and one["process_group"] is None
    if cuda_present():
        assert one["dp"]["weight_device"].startswith("cuda")
    assert _gap(one["plain"]["weights"], one["dp"]["weights"]) <= TOLERANCE
    # One process starts no process group: nothing is all-reduced.
    assert one["dp"]["all_reduces"] == {}


@pytest.mark.parametrize("scenario", ["fsdp", "remat", "compiled"])
def test_one_process_fsdp_remat_and_the_compiled_step_equal_plain_keras(one, scenario):
    assert _gap(one["plain"]["weights"], one[scenario]["weights"]) <= TOLERANCE


def test_one_process_bf16_mixed_precision_is_close_to_float32(one):
    gap = _gap(one["plain"]["weights"], one["bf16"]["weights"])
    assert 0 < gap <= 2e-2, gap


def test_two_processes_share_the_gpu_over_gloo_each_on_its_local_rank(two):
    assert [result["rank"] for result in two] == [0, 1]
    assert [result["local_rank"] for result in two] == ["0", "1"]
    assert {result["process_group"] for result in two} == {"gloo"}
    if cuda_present():
        # LOCAL_RANK modulo the GPUs this host has: both on GPU 0 here.
        for result in two:
            count = result["device_count"]
            assert result["current_device"] == int(result["local_rank"]) % count
            assert result["dp"]["weight_device"] == f"cuda:{result['current_device']}"


def test_two_processes_sync_the_gradients_on_the_gpus_tensors(two):
    for result in two:
        synced = result["dp"]["all_reduces"]
        kind = "cuda" if cuda_present() else "cpu"
        # At least one gradient all-reduce a step (8 steps), on CUDA tensors.
        assert synced.get(kind, 0) >= 8, synced


@pytest.mark.parametrize("scenario", ["dp", "fsdp", "remat", "compiled", "checkpoint"])
def test_two_processes_equal_one_within_1e_5(one, two, scenario):
    for result in two:
        assert _gap(one[scenario]["weights"], result[scenario]["weights"]) <= TOLERANCE


def test_two_processes_bf16_is_close_to_one(one, two):
    for result in two:
        assert _gap(one["bf16"]["weights"], result["bf16"]["weights"]) <= 2e-2


def test_checkpoints_restore_exactly(one, two):
    for result in [one, *two]:
        assert result["checkpoint"]["restored_step"] == 8
        assert result["checkpoint"]["restore_gap"] == 0.0


def test_cudas_out_of_memory_error_is_raised_as_keras_dists(tmp_path):
    needs_cuda("torch's CUDA out-of-memory error")
    (result,) = _launch(1, "oom", tmp_path)
    oom = result["oom"]
    assert oom["error"] == "OutOfDeviceMemoryError", oom
    assert oom["cause"] == "OutOfMemoryError", oom
    assert "ran out of device memory" in oom["message"]
