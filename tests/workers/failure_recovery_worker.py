"""One process of a 2-process PyTorch job whose first distributed `fit` raises
(on every rank, at the same batch); the retry must train as a fresh one.

Usage: python failure_recovery_worker.py OUTPUT_JSON
"""

from __future__ import annotations

import json
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402


class Failure(RuntimeError):
    pass


class RaiseAtBatchOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise Failure("a callback raised")


def model() -> keras.Model:
    worker_seed.set_random_seed(1)
    net = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    net.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy"
    )
    return net


def fit(net: keras.Model, callbacks: list) -> list[list[float]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(22, 5)).astype("float32")
    y = rng.integers(0, 3, size=(22,))
    net.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return [np.asarray(w).ravel().tolist() for w in net.get_weights()]


def main(output: str) -> None:
    distribution = kd.DataParallel()
    fresh = fit(model(), [kd.DistributeCallback(distribution)])
    failing = model()
    initial = failing.get_weights()
    try:
        fit(failing, [kd.DistributeCallback(distribution), RaiseAtBatchOne()])
    except Failure:
        pass
    else:
        raise AssertionError("the first fit should have raised")
    still_on = kd.distribution() is not None
    failing.set_weights(initial)
    retried = fit(failing, [kd.DistributeCallback(distribution)])
    plain = fit(model(), [])
    with open(output, "w") as file:
        json.dump(
            {
                "fresh": fresh,
                "retried": retried,
                "plain": plain,
                "still_on": still_on,
                "processes": kd.num_processes(),
            },
            file,
        )


if __name__ == "__main__":
    main(sys.argv[1])
