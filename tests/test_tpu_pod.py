"""`examples/tpu_pod.py` run as a Cloud TPU slice runs it (docs/tpu-pods.md).

4 real processes x 2 simulated CPU devices stand for 4 TPU VM workers x 2
chips: each gets what a worker of a slice has, `TPU_WORKER_HOSTNAMES` (the
4 workers, all loopback here) and its `TPU_WORKER_ID`, with
`TPU_SKIP_MDS_QUERY=1` (no metadata server) and the coordinator's port in
`KERAS_DIST_COORDINATOR_PORT` (a free one: on a slice it is JAX's 8482), and
`kd.initialize()` finds the job from them alone. Collectives over gloo.
"""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest

from keras_dist import cluster
from keras_dist.cluster import find_free_port
from tests.fork_server import start_python
from tests.multiprocess import WORKERS, wait_then_clean_up

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tpu_pod.py"
HOSTS, CHIPS = 4, 2

pytestmark = pytest.mark.backend("jax")


def _clean_environment() -> dict[str, str]:
    """This process' environment without any job's variables."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("KERAS_DIST")
        and name not in cluster.ENVIRONMENT_VARIABLES
    }


def _worker_environment(worker: int, port: int) -> dict[str, str]:
    return {
        **_clean_environment(),
        "KERAS_BACKEND": "jax",
        "KERAS_DIST_CPU_DEVICES": str(CHIPS),
        "TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * HOSTS),
        "TPU_WORKER_ID": str(worker),
        "TPU_SKIP_MDS_QUERY": "1",
        "KERAS_DIST_COORDINATOR_PORT": str(port),
        "KERAS_DIST_INIT_TIMEOUT": "60",
    }


def _run(children: list, logs: list[pathlib.Path], timeout: float) -> None:
    wait_then_clean_up([(child, None) for child in children], timeout)
    failed = [rank for rank, child in enumerate(children) if child.returncode]
    if failed:
        raise AssertionError(
            "\n".join(
                f"--- worker {rank} (exit {children[rank].returncode}) ---\n"
                + logs[rank].read_text()[-4000:]
                for rank in failed
            )
        )


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    """The 4-worker job, then the 1-process x 8-device reference and restore."""
    directory = tmp_path_factory.mktemp("tpu_pod")
    port = find_free_port()
    logs = [directory / f"worker-{worker}.txt" for worker in range(HOSTS)]
    workers = [
        start_python(
            [
                EXAMPLE,
                "--checkpoint-dir",
                directory / "checkpoints",
                "--weights",
                directory / "final.weights.h5",
                "--epochs",
                "1",
            ],
            env=_worker_environment(worker, port),
            output=logs[worker],
            cwd=directory,
        )
        for worker in range(HOSTS)
    ]
    _run(workers, logs, timeout=240)
    reference_log = directory / "reference.txt"
    reference = start_python(
        [WORKERS / "tpu_pod_reference.py", directory, directory / "weights.npz"],
        env={
            **_clean_environment(),
            "KERAS_BACKEND": "jax",
            "KERAS_DIST_CPU_DEVICES": str(HOSTS * CHIPS),
        },
        output=reference_log,
        cwd=directory,
    )
    _run([reference], [reference_log], timeout=180)
    with np.load(directory / "weights.npz") as arrays:
        weights = dict(arrays)
    return directory, logs, weights


def _weights(weights: dict, name: str) -> list[np.ndarray]:
    count = sum(1 for key in weights if key.startswith(f"{name}_"))
    return [weights[f"{name}_{index}"] for index in range(count)]


def test_every_worker_joins_the_slice_from_its_tpu_variables(pod):
    _, logs, _ = pod
    for worker, log in enumerate(logs):
        text = log.read_text()
        assert f"host {worker} of {HOSTS}: mesh (4, 2) over 8 chips" in text
    # One voice: worker 0 alone shows the progress bar.
    progress = re.compile(r"\bloss: \d")  # Keras' progress bar ("loss: 2.31")
    assert progress.search(logs[0].read_text())
    assert not any(progress.search(log.read_text()) for log in logs[1:])


def test_the_pod_trains_as_one_process_with_8_devices(pod):
    _, _, weights = pod
    reference, trained = _weights(weights, "reference"), _weights(weights, "pod")
    assert len(trained) == len(reference) == 6
    for got, expected in zip(trained, reference, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    initial = _weights(weights, "initial")
    moved = max(np.abs(a - b).max() for a, b in zip(trained, initial, strict=True))
    assert moved > 1e-3, "the pod's weights must have trained"


def test_the_pods_checkpoint_restores_onto_one_process_with_8_devices(pod):
    directory, _, weights = pod
    assert int(weights["step"]) == 8  # 1024 rows / 128, 1 epoch
    assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == [
        "step-000000008"
    ]
    for got, expected in zip(
        _weights(weights, "restored"), _weights(weights, "pod"), strict=True
    ):
        np.testing.assert_array_equal(got, expected)
