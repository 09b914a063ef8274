"""One rank of a job that checkpoints every 2 steps until it is killed.

Usage: python checkpoint_kill_worker.py CHECKPOINT_DIR STATE_DIR
Started by `keras-dist launch`; the backend comes from KERAS_BACKEND. Every
rank writes `pid-<rank>` into STATE_DIR once it trains, so that a test can
`kill -9` one of them at a moment of its choosing; `fit` runs until the
test kills it (50 epochs of 200 steps: minutes, far longer than any test).
Process 0 writes `CHECKPOINT_DIR/ckpt.keras` and `ckpt.weights.h5` every 2
steps.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import worker_seed

import keras_dist as kd


def build() -> keras.Model:
    worker_seed.set_random_seed(3)
    net = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    net.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return net


class AnnounceTraining(keras.callbacks.Callback):
    """Write this rank's pid once the first step ran."""

    def __init__(self, state_dir: str):
        super().__init__()
        self.state_dir = state_dir

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            path = os.path.join(self.state_dir, f"pid-{kd.process_id()}")
            with open(path + ".part", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(path + ".part", path)


def main() -> None:
    checkpoints, state_dir = sys.argv[1:]
    kd.initialize()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    build().fit(
        x,
        y,
        batch_size=4,
        epochs=50,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            AnnounceTraining(state_dir),
            keras.callbacks.ModelCheckpoint(
                os.path.join(checkpoints, "ckpt.keras"), save_freq=2
            ),
            keras.callbacks.ModelCheckpoint(
                os.path.join(checkpoints, "ckpt.weights.h5"),
                save_weights_only=True,
                save_freq=2,
            ),
        ],
    )


if __name__ == "__main__":
    main()
