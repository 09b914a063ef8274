"""One rank of a 2-process job that trains with `kd.callbacks.Throughput` while
rank 1 sleeps after every step (tests/test_throughput.py), 2 epochs of 120 rows
in global batches of 16: 7 full batches and one of 8.

Usage: python throughput_worker.py OUTPUT_JSON

Writes this rank's `History` (the Throughput keys included) to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_dist.callbacks import Throughput  # noqa: E402

SLEEP_SECONDS = 0.04
RANK = kd.process_id()


class SlowRank(keras.callbacks.Callback):
    """Rank 1 spends longer outside each step; the others wait for it."""

    def on_train_batch_end(self, batch, logs=None):
        if RANK == 1:
            time.sleep(SLEEP_SECONDS)


def main() -> None:
    worker_seed.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(120, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            Throughput(16),
            SlowRank(),
        ],
    )
    with open(sys.argv[1], "w") as handle:
        json.dump({"history": history.history}, handle)


if __name__ == "__main__":
    main()
