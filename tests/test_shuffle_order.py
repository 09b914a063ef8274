"""`fit(shuffle=...)` draws Keras' own order, from Keras' own generators.

With `keras.utils.set_random_seed(seed)`, keras_dist trains on the batches in
the order plain Keras on one device draws, on any device or process count, and
leaves NumPy's, Python's (and torch's) global generators where plain Keras
leaves them. The model is plain SGD on 37 samples in batches of 8, so the
weights after 2 epochs depend on the order.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.conftest import BACKEND
from tests.multiprocess import run_job
from tests.workers import shuffle_scenario

KINDS = ["arrays", "batch", "py_dataset"]


@pytest.fixture(scope="module")
def plain_keras() -> dict:
    """Plain Keras on one device, per kind of shuffled input."""
    return {kind: shuffle_scenario.train(kind, []) for kind in KINDS}


def assert_same_training(result: dict, reference: dict) -> None:
    for ours, expected in zip(result["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    # The generators advanced exactly as in plain Keras: later draws agree.
    assert result["next_draws"] == reference["next_draws"]


@pytest.mark.parametrize("kind", KINDS)
def test_shuffled_fit_on_every_device_matches_plain_keras(kind, plain_keras):
    """JAX and TensorFlow: every simulated device; PyTorch: one process."""
    distribution = kd.DataParallel(devices=kd.list_devices())
    result = shuffle_scenario.train(kind, [kd.DistributeCallback(distribution)])
    assert_same_training(result, plain_keras[kind])


def test_the_model_depends_on_the_order(plain_keras):
    """Otherwise the tests above could not tell two orders apart."""
    keras.utils.set_random_seed(shuffle_scenario.SEED)
    unshuffled = shuffle_scenario.model()
    x, y = shuffle_scenario.data()
    unshuffled.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    difference = max(
        float(np.abs(np.asarray(shuffled) - weights).max())
        for shuffled, weights in zip(
            plain_keras["arrays"]["weights"], unshuffled.get_weights(), strict=True
        )
    )
    assert difference > 1e-3


PROCESS_ENV = {"jax": {"KERAS_DIST_CPU_DEVICES": "2"}, "torch": {}, "tensorflow": {}}


# ("arrays", "same") is the easier case of "apart"; left out for CI's time.
# TensorFlow: the shuffled PyDataset only (its shuffled arrays across process
# counts: tests/test_checkpoint_jobs.py).
IN_PROCESSES = {
    "jax": KINDS,
    "torch": KINDS,
    "tensorflow": ["py_dataset"],
}


def test_shuffled_fit_in_two_processes_matches_plain_keras(plain_keras, tmp_path):
    """2 processes (JAX: 2 devices each), each kind of shuffled input in turn
    (one job: one start-up). "apart": after seeding alike, the processes'
    generators are moved apart; process 0's draws are used and every process
    ends where plain Keras does."""
    kinds = IN_PROCESSES[BACKEND]
    results = run_job(
        "shuffle_worker.py",
        [",".join(kinds), "apart"],
        processes=2,
        env={"KERAS_BACKEND": BACKEND, **PROCESS_ENV[BACKEND]},
        output_dir=tmp_path,
    )
    assert [result["processes"] for result in results] == [2, 2]
    for kind in kinds:
        for result in results:
            try:
                assert_same_training(result[kind], plain_keras[kind])
            except AssertionError as error:
                raise AssertionError(f"{kind}: {error}") from error
