"""One process of a JAX job whose kernels are split across the processes.

Usage: python model_parallel_saving_worker.py DIRECTORY OUTPUT_JSON
The job comes from KERAS_DISTRIBUTION_*; with 2 processes of 2 CPU devices the
mesh (1, 4) puts the "model" axis over both processes, so each kernel has
columns (or rows) on each process. `fit` with two ModelCheckpoints, then what
users call on every process after `fit`: `get_weights`, `save`,
`save_weights`, and `load_weights` back into the sharded model.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import worker_seed

import keras_dist as kd


def build() -> keras.Model:
    worker_seed.set_random_seed(4)
    net = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    net.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    return net


def distribution() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((1, 4), ("batch", "model"))
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    layout_map["dense_1/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def main() -> None:
    directory, output = sys.argv[1:]
    kd.initialize()
    import jax  # noqa: PLC0415 (after the job is formed)

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    net = build()
    net.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(distribution()),
            keras.callbacks.ModelCheckpoint(os.path.join(directory, "ckpt.keras")),
            keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "ckpt.weights.h5"), save_weights_only=True
            ),
        ],
    )
    split = jax.process_count() > 1
    kernel = net.layers[0].kernel.value
    assert kernel.is_fully_addressable != split, "the kernel spans the processes"
    weights = net.get_weights()
    net.save(os.path.join(directory, "m.keras"))
    net.save_weights(os.path.join(directory, "w.weights.h5"))
    net.set_weights([np.zeros_like(w) for w in weights])
    net.load_weights(os.path.join(directory, "w.weights.h5"))
    kernel = net.layers[0].kernel.value
    result = {
        "weights": [w.tolist() for w in weights],
        "loaded_back_error": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(net.get_weights(), weights, strict=True)
        ),
        "still_split": kernel.is_fully_addressable != split,  # after load_weights
        "devices": jax.device_count(),
    }
    with open(output, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
