"""The training the cluster integration tests compare (no backend imports):
a tiny model on 40 rows, 2 epochs, global batch 8, no shuffling."""

from __future__ import annotations

import keras
import numpy as np
import worker_seed

import keras_dist as kd


def train(distribution: kd.Distribution | None) -> list[list]:
    """Fit the model, under `distribution` (None: plain Keras on one device);
    return its weights as nested lists."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    worker_seed.set_random_seed(7)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    return [weight.tolist() for weight in model.get_weights()]
