"""Scenarios every backend's worker runs the same way (no backend imports).

The workers call `kd.initialize()` before importing this module's users.
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np
import worker_seed

import keras_dist as kd


def classification_data() -> tuple[np.ndarray, np.ndarray]:
    """45 samples of 6 features, one-hot labels of 3 classes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(45, 6)).astype("float32")
    y = rng.integers(0, 3, size=(45,))
    return x, keras.utils.to_categorical(y, 3)


def classification_model(batch_norm: bool = False) -> keras.Model:
    layers = [keras.Input((6,))]
    if batch_norm:
        # Statistics over rows and positions (Conv1D), then over rows (Dense).
        layers += [
            keras.layers.Reshape((6, 1)),
            keras.layers.Conv1D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
        ]
    layers.append(keras.layers.Dense(16, activation="relu"))
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(3, activation="softmax"))
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="categorical_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
        weighted_metrics=[keras.metrics.MeanSquaredError(name="mse")],
    )
    return model


def train(
    *,
    batch_norm: bool = False,
    sync_batch_norm: bool = True,
    sample_weights: bool = False,
    shuffle: bool,
    verbose: int,
) -> dict:
    """fit (with validation), predict and evaluate the classification model
    under `kd.DataParallel()`; what the parity tests compare."""
    # Different seeds on purpose: process 0's weights must win everywhere.
    worker_seed.set_random_seed(100 + kd.process_id())
    model = classification_model(batch_norm)  # built before the distribution
    result = fit_predict_evaluate(
        model,
        kd.DataParallel(sync_batch_norm=sync_batch_norm),
        sample_weights=sample_weights,
        shuffle=shuffle,
        verbose=verbose,
    )
    result["devices"] = kd.list_devices()
    return result


def fit_predict_evaluate(
    model: keras.Model,
    distribution: kd.Distribution,
    *,
    sample_weights: bool = False,
    shuffle: bool,
    verbose: int,
    fit_callbacks: tuple = (),
) -> dict:
    """fit (3 epochs, batch 12, with validation), predict and evaluate `model`
    on the classification data under `distribution`."""
    x, y = classification_data()
    weights = (
        np.linspace(0.5, 1.5, len(x)).astype("float32") if sample_weights else None
    )
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=12,
        epochs=3,
        shuffle=shuffle,
        verbose=verbose,
        validation_data=(x[:20], y[:20]),
        callbacks=[kd.DistributeCallback(distribution), *fit_callbacks],
    ).history
    predictions = model.predict(
        x, batch_size=12, verbose=0, callbacks=[kd.DistributeCallback(distribution)]
    )
    evaluation = model.evaluate(
        x,
        y,
        batch_size=7,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history,
        "evaluation": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        "processes": kd.num_processes(),
    }


def different_data() -> dict:
    """Each process reads different data: splitting it would lose samples."""
    x = np.full((16, 6), float(kd.process_id()), "float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(
            x,
            x[:, :1],
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def lose_a_process() -> dict:
    """Process 1 dies in the middle of the second epoch."""

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if kd.process_id() == 1 and self.epoch == 1 and batch == 2:
                os._exit(17)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    x = np.random.default_rng(0).normal(size=(400, 6)).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    started = time.monotonic()
    try:
        model.fit(
            x,
            x[:, :1],
            batch_size=8,
            epochs=50,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel()), Die()],
        )
    except Exception as error:  # the survivors must get here, not hang
        print(f"survivor error after {time.monotonic() - started:.1f}s: {error}")
        raise
    return {}
