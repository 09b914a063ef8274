"""Train a few steps under `kd.Checkpoint` on one backend, for a restore on another.

Usage: python checkpoint_cross_worker.py CHECKPOINT_DIR OUTPUT_JSON
The backend comes from KERAS_BACKEND. Trains `EPOCHS` epochs under
`kd.DataParallel` with a blocking `kd.Checkpoint` (one save an epoch), then
writes to OUTPUT_JSON the predictions on `probe()`, the optimizer's iteration
count and the loss history. `tests/test_checkpoint_cross_backend.py` builds the
same model (`build`) on another backend and restores it.
"""

from __future__ import annotations

import json
import sys

import keras
import numpy as np
import worker_seed

import keras_dist as kd

ROWS, BATCH, EPOCHS = 32, 8, 2  # 4 steps an epoch


def build() -> keras.Model:
    """The same model on every backend: layers named, Adam, a metric."""
    worker_seed.set_random_seed(5)
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    outputs = keras.layers.Dense(2, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="crossed")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = np.stack([x.sum(axis=1), x[:, 0] - x[:, 1]], axis=1).astype("float32")
    return x, y


def probe() -> np.ndarray:
    """Fixed inputs the predictions are compared on."""
    return np.random.default_rng(1).normal(size=(5, 6)).astype("float32")


def main() -> None:
    directory, output = sys.argv[1], sys.argv[2]
    model = build()
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory, save_freq="epoch", save_on_background=False),
        ],
    )
    keras.distribution.set_distribution(None)
    with open(output, "w") as handle:
        json.dump(
            {
                "backend": keras.backend.backend(),
                "predictions": model.predict(probe(), verbose=0).tolist(),
                "iterations": int(
                    keras.ops.convert_to_numpy(model.optimizer.iterations)
                ),
                "loss": history.history["loss"],
            },
            handle,
        )


if __name__ == "__main__":
    main()
