"""Keras' `gradient_accumulation_steps` under `kd.DataParallel`: k micro-batches
train the same weights as plain Keras on one device with one batch k times
larger (and as plain Keras with the same accumulation), with SGD + momentum
and with Adam. On PyTorch DDP all-reduces the gradients once per k steps.

JAX and TensorFlow: one process, 8 simulated devices (KERAS_DIST_CPU_DEVICES=8).
PyTorch: one job of 2 processes (gloo).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job
from tests.workers import gradient_accumulation_worker as worker

PARITY = 1e-5


def _assert_parity(result: dict) -> None:
    for name in worker.OPTIMIZERS:
        trained = result[name]
        # One weight update per ACCUMULATION micro-steps (Keras counts them so).
        assert trained["iterations"] == worker.MICRO_STEPS // worker.ACCUMULATION
        assert trained["big_batch_iterations"] == trained["iterations"]
        for reference in ("plain_accumulation", "big_batch"):
            for ours, theirs in zip(
                trained["distributed"], trained[reference], strict=True
            ):
                np.testing.assert_allclose(
                    ours, theirs, atol=PARITY, rtol=0, err_msg=f"{name} {reference}"
                )


@pytest.mark.backend("jax", "tensorflow")
def test_accumulation_matches_one_big_batch_on_8_devices():
    """On TensorFlow plain Keras cannot do this under a MirroredStrategy (its
    optimizer's `merge_call` inside a `tf.cond` raises)."""
    devices = kd.list_devices()[:8]
    assert len(devices) == 8
    _assert_parity(worker.run(lambda: kd.DataParallel(devices=devices)))
    assert kd.distribution() is None


@pytest.mark.backend("tensorflow")
def test_accumulation_inside_a_replica_is_a_clear_error_on_tensorflow():
    """A LossScaleOptimizer applies its inner optimizer inside each replica,
    where TensorFlow rejects accumulation's conditional update (plain Keras
    under a MirroredStrategy raises a RuntimeError about `merge_call`)."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2, name="out")])
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner), loss="mse")
    x, y = worker.data()
    distribution = kd.DataParallel(devices=kd.list_devices()[:2])
    with pytest.raises(ValueError, match="gradient_accumulation_steps.*Loss"):
        model.fit(
            x,
            y,
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution)],
        )
    assert kd.distribution() is None


@pytest.mark.backend("torch")
def test_accumulation_all_reduces_once_per_update_on_torch(tmp_path):
    """2 processes. A communication hook counts DDP's gradient all-reduces: one
    per weight update (the model's gradients fit in one bucket), none on the
    micro-steps in between."""
    results = run_job(
        "gradient_accumulation_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    updates = worker.MICRO_STEPS // worker.ACCUMULATION
    for result in results:
        assert result["processes"] == 2
        _assert_parity(result)
        # One DistributedDataParallel per optimizer's distributed fit.
        assert result["all_reduces"] == [updates] * len(worker.OPTIMIZERS)
    assert results[0] == results[1]
