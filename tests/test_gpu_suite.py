"""The GPU run's scripts stay runnable where CI has no GPU: the shell scripts
parse, the benchmarks parse their arguments without importing an engine,
and every test of tests/gpu/ skips here unless asked to run on CPU devices
(`KERAS_DIST_GPU_TESTS_ON_CPU=1`). The GPU run itself: `tests/run_gpu.sh`."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.gpu import conftest as gpu_conftest

pytestmark = pytest.mark.backend_neutral

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["tests/run_gpu.sh", "tests/gpu_wheels.sh"])
def test_the_gpu_runs_shell_scripts_parse(script):
    path = REPO / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(
    "script",
    [
        "benchmarks/gpu_speed.py",
        "benchmarks/gemma_full_finetune.py",
        "benchmarks/llama_8b_capped.py",
    ],
)
def test_the_gpu_benchmarks_parse_their_arguments(script):
    completed = subprocess.run(
        [sys.executable, str(REPO / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr
    assert "--json" in completed.stdout


def test_the_gpu_suite_runs_only_on_a_gpu_or_when_asked(monkeypatch):
    monkeypatch.delenv(gpu_conftest.ON_CPU_VARIABLE, raising=False)
    assert not gpu_conftest.on_cpu()
    monkeypatch.setenv(gpu_conftest.ON_CPU_VARIABLE, "1")
    assert gpu_conftest.on_cpu()
