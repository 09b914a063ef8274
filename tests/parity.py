"""The model, data and checks that single-process parity tests share.

Each backend's training tests build the same model on the same data, train it
on one device and under a distribution, and compare with these helpers.
"""

from __future__ import annotations

import keras
import numpy as np

import keras_dist as kd

SAMPLES = 101  # divides neither the global batches used nor the device counts


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, size=(SAMPLES,))
    return x, y


def layers() -> list:
    return [
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.Dense(3, activation="softmax", name="head"),
    ]


def compile_model(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    return model


def sequential() -> keras.Model:
    keras.utils.set_random_seed(1)
    return compile_model(keras.Sequential(layers()))


def batch_norm_sequential() -> keras.Model:
    """BatchNormalization over rows and positions (Conv1D), then over rows."""
    keras.utils.set_random_seed(1)
    return compile_model(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Reshape((6, 1)),
                keras.layers.Conv1D(4, 3, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    )


class FunctionalTrainer(kd.Trainer, keras.Model):
    pass


def functional_trainer(distribution) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(hidden)
    return compile_model(FunctionalTrainer(inputs, outputs, distribution=distribution))


def fit_evaluate_predict(
    model, callbacks_factory, *, batch, epochs, sample_weight=None
):
    """`fit` (with validation), `evaluate` and `predict` on the same data;
    `callbacks_factory()` gives each call its callbacks."""
    x, y = data()
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        validation_data=(x[:37], y[:37]),
        callbacks=callbacks_factory(),
    )
    evaluation = model.evaluate(
        x,
        y,
        batch_size=batch,
        verbose=0,
        return_dict=True,
        callbacks=callbacks_factory(),
    )
    predictions = model.predict(
        x, batch_size=batch, verbose=0, callbacks=callbacks_factory()
    )
    return history.history, evaluation, predictions


def assert_same_training(reference, candidate, reference_model, candidate_model):
    ref_history, ref_eval, ref_pred = reference
    history, evaluation, predictions = candidate
    for a, b in zip(
        reference_model.get_weights(), candidate_model.get_weights(), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], atol=1e-5, rtol=0)
    assert evaluation.keys() == ref_eval.keys()
    for key in ref_eval:
        np.testing.assert_allclose(evaluation[key], ref_eval[key], atol=1e-5, rtol=0)
    assert predictions.shape == (SAMPLES, 3)
    np.testing.assert_allclose(predictions, ref_pred, atol=1e-5, rtol=0)
