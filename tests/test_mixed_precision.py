"""Mixed precision (`mixed_float16`, a `LossScaleOptimizer`) and
`steps_per_execution` under keras_dist, compared with plain Keras on one device.

One process: 4 simulated devices on JAX and TensorFlow (run with
KERAS_DIST_CPU_DEVICES=8), the one-process job on PyTorch. A float16 overflow
on one replica only: 2 simulated devices on JAX and TensorFlow, a 2-process job
on PyTorch (tests/workers/loss_scale_worker.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job
from tests.workers import loss_scale_worker

SAMPLES = 42  # the last batch of 8 has 2 rows: padded on 4 devices
BATCH = 8
EPOCHS = 2
STEPS = EPOCHS * -(-SAMPLES // BATCH)

# Float16 tolerance. The variables stay float32, but every product and every
# gradient is rounded to float16 (relative error 2**-11 ~ 4.9e-4), and 4
# replicas add their gradients in another order than one device: each Adam
# update (at most lr = 0.01 per weight) may differ by a few float16 roundings
# of itself, so after STEPS = 12 updates the weights agree to about
# 12 * 0.01 * 3 * 4.9e-4 ~ 1.8e-4. Measured: 2e-5 (TensorFlow), 6e-5 (JAX).
FLOAT16_ATOL = 2e-4


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = rng.integers(0, 3, size=(SAMPLES,))
    return x, y


def _model(steps_per_execution=1):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
            # Softmax and loss in float32, as Keras' mixed precision guide says.
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def _distribution():
    devices = kd.list_devices()
    return kd.DataParallel(devices=devices[: min(4, len(devices))])


def _fit(model, callbacks=(), epochs=EPOCHS):
    x, y = _data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return history.history


def _loss_scale_state(model):
    """The loss scale, its growth counter and the step counter, by name."""
    optimizer = model.optimizer
    return {
        "dynamic_scale": float(np.asarray(optimizer.dynamic_scale)),
        "step_counter": int(np.asarray(optimizer.step_counter)),
        "iterations": int(np.asarray(optimizer.iterations)),
    }


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _assert_same_training(model, reference, history, reference_history, atol):
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)
    for name, values in reference_history.items():
        np.testing.assert_allclose(history[name], values, atol=atol, rtol=0)


def test_mixed_float16_matches_one_device(mixed_float16):
    """The model is built and compiled outside any scope (on TensorFlow its
    loss-scaling optimizer and the optimizer it wraps belong to the default
    strategy until keras_dist's call)."""
    reference = _model()
    assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
    reference_history = _fit(reference)
    model = _model()
    history = _fit(model, [kd.DistributeCallback(_distribution())])
    assert model.get_layer(index=0).compute_dtype == "float16"
    _assert_same_training(model, reference, history, reference_history, FLOAT16_ATOL)
    # The same loss scale, grown alike, after the same number of steps.
    assert _loss_scale_state(model) == _loss_scale_state(reference)
    assert _loss_scale_state(model)["iterations"] == STEPS
    assert kd.distribution() is None


def test_mixed_float16_continues_a_plain_keras_fit(mixed_float16):
    """An optimizer already built by plain Keras (its slots and the inner
    optimizer's indices exist) keeps training under the distribution."""
    reference = _model()
    reference_history = _fit(reference)
    model = _model()
    _fit(model, epochs=1)
    history = _fit(model, [kd.DistributeCallback(_distribution())], epochs=1)
    _assert_same_training(
        model,
        reference,
        history,
        {name: values[1:] for name, values in reference_history.items()},
        FLOAT16_ATOL,
    )
    assert _loss_scale_state(model) == _loss_scale_state(reference)


@pytest.mark.backend("jax")
def test_steps_per_execution_matches_one_device():
    reference = _model(steps_per_execution=2)
    reference_history = _fit(reference)
    model = _model(steps_per_execution=2)
    history = _fit(model, [kd.DistributeCallback(_distribution())])
    _assert_same_training(model, reference, history, reference_history, 1e-5)
    assert int(np.asarray(model.optimizer.iterations)) == STEPS


@pytest.mark.backend("tensorflow")
def test_steps_per_execution_on_tensorflow_is_a_clear_error():
    model = _model(steps_per_execution=2)
    with pytest.raises(ValueError, match=r"steps_per_execution=2") as raised:
        _fit(model, [kd.DistributeCallback(_distribution())])
    assert "TensorFlow" in str(raised.value)
    assert "keras-team/keras#19246" in str(raised.value)
    assert kd.distribution() is None
    # Nothing was changed: with steps_per_execution=1 the same model trains.
    reference = _model()
    reference_history = _fit(reference)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = _fit(model, [kd.DistributeCallback(_distribution())])
    _assert_same_training(model, reference, history, reference_history, 1e-5)


@pytest.mark.backend("torch")
def test_steps_per_execution_on_torch_does_what_plain_keras_does():
    """As plain Keras of this release: Keras 3.15's PyTorch trainer refuses
    steps_per_execution > 1, and the call raises that once the distribution
    is on, which must not stay on; Keras 3.16 runs the steps of an execution
    in turn, and keras_dist trains as plain Keras does."""
    reference = _model(steps_per_execution=2)
    try:
        reference_history = _fit(reference)
    except ValueError as error:
        assert "must be 1 with the PyTorch backend" in str(error)
        model = _model(steps_per_execution=2)
        with pytest.raises(ValueError, match="must be 1 with the PyTorch backend"):
            _fit(model, [kd.DistributeCallback(_distribution())])
        assert kd.distribution() is None
        return
    model = _model(steps_per_execution=2)
    history = _fit(model, [kd.DistributeCallback(_distribution())])
    _assert_same_training(model, reference, history, reference_history, 1e-5)
    assert int(np.asarray(model.optimizer.iterations)) == STEPS
    assert kd.distribution() is None


# -- a float16 overflow on one replica only ----------------------------------------
def _assert_step_skipped_as_on_one_device(result: dict) -> None:
    """The one-device reference skipped the overflowing first step (its loss
    scale halved from Keras' initial 2**15, no update), then trained on; the
    distributed training did exactly the same."""
    reference, ours = result["one_device"], result["distributed"]
    steps = loss_scale_worker.STEPS
    assert (reference["dynamic_scale"], reference["iterations"]) == (2**14, steps - 1)
    assert reference["step_counter"] == steps - 1
    for name in ("dynamic_scale", "step_counter", "iterations"):
        assert ours[name] == reference[name], name
    for weights, expected in zip(ours["weights"], reference["weights"], strict=True):
        assert np.isfinite(weights).all()
        np.testing.assert_allclose(weights, expected, atol=FLOAT16_ATOL, rtol=0)


class _ReplicaCopies(keras.callbacks.Callback):
    """Each device's copy of every weight and of the loss scale, at the end of
    the epoch (the distribution is still on)."""

    def on_epoch_end(self, epoch, logs=None):
        variables = [*self.model.weights, self.model.optimizer.dynamic_scale]
        self.copies = [_device_copies(variable.value) for variable in variables]


def _device_copies(value):
    if hasattr(value, "addressable_shards"):  # a replicated JAX array
        return [np.asarray(shard.data) for shard in value.addressable_shards]
    return [np.asarray(copy) for copy in value.values]  # a TF MirroredVariable


@pytest.mark.backend("jax", "tensorflow")
def test_an_overflow_on_one_device_skips_the_step_on_every_device():
    """2 simulated devices; the overflowing row is in device 1's half of the
    first batch. The finiteness check must see the gradients summed over the
    devices (on TensorFlow, Keras' LossScaleOptimizer alone checks replica 0's
    own gradients, then applies the summed ones: NaN weights)."""
    copies = _ReplicaCopies()
    devices = kd.list_devices()[:2]
    result = loss_scale_worker.run(lambda: kd.DataParallel(devices=devices), (copies,))
    _assert_step_skipped_as_on_one_device(result)
    for per_device in copies.copies:
        assert len(per_device) == 2
        np.testing.assert_array_equal(per_device[0], per_device[1])
    assert kd.distribution() is None


@pytest.mark.backend("torch")
def test_an_overflow_on_rank_1_skips_the_step_on_every_rank_on_torch(tmp_path):
    """2 processes; the overflowing row is in rank 1's half of the first batch.
    DDP averages the gradients during backward, before the LossScaleOptimizer
    checks them: both ranks skip the step and halve the scale alike."""
    results = run_job(
        "loss_scale_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    for result in results:
        _assert_step_skipped_as_on_one_device(result)
    # Bit for bit the same weights and loss scale on both ranks.
    assert results[0]["distributed"] == results[1]["distributed"]
