"""The commands of docs/getting-started.md, docs/observability.md and
docs/checkpoints.md, run word for word as a user's shell would
(`tests/doc_commands.py`): the quickstart three ways, `keras-dist devices`,
`keras-dist env`, and a launched job that crashes, restarts and resumes.
They run JAX (named, or the scripts' default): under the suite's JAX run."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from tests.doc_commands import documented_command, run_documented

pytestmark = pytest.mark.backend("jax")

FINAL = re.compile(r"^Final test accuracy: ([0-9.]+) \(loss [0-9.]+\)$", re.M)


def _succeeded(result) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def test_the_quickstart_on_eight_simulated_devices(tmp_path: pathlib.Path):
    # The same command as the venv's path (getting-started.md writes both):
    # `run_documented` runs either as this interpreter.
    documented_command(".venv/bin/python examples/quickstart.py")
    stdout = _succeeded(
        run_documented("python examples/quickstart.py", directory=tmp_path)
    )
    assert "Backend: jax" in stdout
    devices = [f"cpu:{index}" for index in range(8)]
    assert f"Devices: {devices}" in stdout, stdout
    # 10 epochs reach about 0.97 on the held-out digits.
    assert float(FINAL.search(stdout).group(1)) > 0.9, stdout


def test_the_quickstart_on_four_devices_and_for_three_epochs(tmp_path: pathlib.Path):
    stdout = _succeeded(
        run_documented(
            "KERAS_DIST_CPU_DEVICES=4 python examples/quickstart.py",
            directory=tmp_path,
        )
    )
    assert "Devices: ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']" in stdout, stdout
    assert FINAL.search(stdout), stdout
    stdout = _succeeded(
        run_documented(
            "KERAS_BACKEND=jax python examples/quickstart.py --epochs 3",
            directory=tmp_path,
        )
    )
    assert "Epoch 3/3" in stdout and "Epoch 4/" not in stdout, stdout
    assert FINAL.search(stdout), stdout


def test_keras_dist_devices_and_env(tmp_path: pathlib.Path):
    stdout = _succeeded(
        run_documented(
            "KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 keras-dist devices",
            directory=tmp_path,
        )
    )
    assert "cpu:7" in stdout, stdout
    stdout = _succeeded(
        run_documented(
            "KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 keras-dist devices --json",
            directory=tmp_path,
        )
    )
    assert json.loads(stdout) == {
        "backend": "jax",
        "num_processes": 1,
        "process_id": 0,
        "local_device_count": 8,
        "devices": [f"cpu:{index}" for index in range(8)],
        "device_kind": "cpu",
    }
    stdout = _succeeded(
        run_documented(
            "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "
            "keras-dist env",
            directory=tmp_path,
        )
    )
    assert "Detected: TorchrunEnvironment" in stdout, stdout
    assert "2 process(es), this one is process 0, coordinator 127.0.0.1:29500" in stdout


def test_the_launched_job_that_crashes_restarts_and_resumes(tmp_path: pathlib.Path):
    """docs/checkpoints.md: with the example's defaults (3 epochs of 29 steps,
    a save every 10 steps), rank 1 kills itself after step 25; the launcher
    starts the job again and it resumes from step 20 (or 10, when step 20's
    background save was not written yet) into `resume_after_crash_checkpoints`
    of the working directory."""
    result = run_documented(
        "keras-dist launch --nproc-per-node 2 --max-restarts 1 "
        "examples/resume_after_crash.py --crash-at-step 25",
        directory=tmp_path,
    )
    stdout = _succeeded(result)
    context = stdout[-3000:] + result.stderr[-3000:]
    assert "rank 1 was killed by signal SIGKILL" in result.stderr, context
    assert re.search(
        r"Resumed from step (10|20) \(restart 1\); trained to step 87", stdout
    ), context
    assert (tmp_path / "resume_after_crash_checkpoints").is_dir()
