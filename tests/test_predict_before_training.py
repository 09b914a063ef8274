"""`predict` and `evaluate` on a model that never trained, as plain Keras allows.

Built but never compiled, compiled but never trained, or a `Sequential` without
an `Input` that `predict` itself builds: each gives the same predictions (and
evaluation) under `kd.DistributeCallback` as plain Keras on one device.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd

SAMPLES = 37  # divides neither the batch nor the device count


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 2)).astype("float32")
    return x, y


def _model(case: str) -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = [] if case == "unbuilt" else [keras.Input((6,))]
    model = keras.Sequential(
        [*inputs, keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    )
    if case != "uncompiled":
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"]
        )
    return model


def _distribution() -> kd.DataParallel:
    return kd.DataParallel(devices=kd.list_devices())


@pytest.mark.parametrize("case", ["uncompiled", "compiled", "unbuilt"])
def test_predict_before_training_matches_plain_keras(case):
    x, _ = _data()
    expected = _model(case).predict(x, batch_size=8, verbose=0)
    model = _model(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = model.predict(
            x,
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(_distribution())],
        )
    assert predictions.shape == (SAMPLES, 2)
    np.testing.assert_allclose(predictions, expected, atol=1e-5, rtol=0)
    # JAX: every variable (the unbuilt optimizer's counter too) is laid out,
    # so Keras does not warn about "a mix of local and distributed variables".
    mixed = [w for w in caught if "mix of local" in str(w.message)]
    assert not mixed, [str(w.message) for w in mixed]


@pytest.mark.parametrize("case", ["compiled", "unbuilt"])
def test_evaluate_before_training_matches_plain_keras(case):
    x, y = _data()
    expected = _model(case).evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    model = _model(case)
    evaluation = model.evaluate(
        x,
        y,
        batch_size=8,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(_distribution())],
    )
    assert evaluation.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(evaluation[name], value, atol=1e-5, rtol=0)


def test_fit_after_predict_before_training_matches_plain_keras():
    """The optimizer built by the `fit` after an untrained `predict`."""
    x, y = _data()
    reference = _model("compiled")
    reference.predict(x, batch_size=8, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _model("compiled")
    model.predict(
        x, batch_size=8, verbose=0, callbacks=[kd.DistributeCallback(_distribution())]
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution())],
    )
    for ours, expected in zip(
        model.get_weights(), reference.get_weights(), strict=True
    ):
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
