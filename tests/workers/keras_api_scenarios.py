"""Models and data of the Keras-API parity tests, shared by the worker and the
test process (no backend imports, no `kd.initialize()`)."""

from __future__ import annotations

import keras
import numpy as np
import worker_seed

import keras_dist as kd

ROWS = 32
BATCH = 8  # the global batch: 4 rows per process in a 2-process job


def regression_data() -> tuple[np.ndarray, np.ndarray]:
    x = (np.arange(ROWS * 4, dtype="float32").reshape(ROWS, 4) % 7) / 7.0
    return x, x.sum(axis=1, keepdims=True) * 0.5


def tf_dataset():
    """The global dataset: batches of `BATCH` rows, in order."""
    import tensorflow as tf  # noqa: PLC0415

    return tf.data.Dataset.from_tensor_slices(regression_data()).batch(BATCH)


class Regressor(kd.Trainer, keras.Model):
    """A functional model that trains under the global keras_dist distribution."""


def regressor(*, trainer: bool) -> keras.Model:
    worker_seed.set_random_seed(3)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, name="linear")(inputs)
    model = (Regressor if trainer else keras.Model)(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def classification_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    return x, rng.integers(0, 3, size=(40,))


def classifier() -> keras.Model:
    worker_seed.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(4, activation="relu", name="middle"),
            keras.layers.Dense(3, activation="softmax", name="head"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
    )
    return model


# Kernels mapped with one axis for two dimensions: the trailing one replicated.
SHORT_LAYOUTS = {"hidden/kernel": ("model",), "head/kernel": ("model",)}


def fit_classifier(model: keras.Model, callbacks: list) -> list[np.ndarray]:
    x, y = classification_data()
    model.fit(
        x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model.get_weights()
