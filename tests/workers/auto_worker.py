"""One process of a multi-process `"auto"` job (JAX, CPU devices, gloo).

Usage: python auto_worker.py OUTPUT_JSON
Process 0 compiles the candidates for every process' devices and tells the
others; each writes what it chose and the weights it trained to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402


def main(output: str) -> None:
    worker_seed.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(256), keras.layers.Dense(4)]
    )
    model.compile(optimizer="adam", loss="mse")
    x = np.random.RandomState(0).rand(32, 32).astype("float32")
    y = np.random.RandomState(1).rand(32, 4).astype("float32")
    # DataParallel's variables and Adam state alone (114 KB a device) do not
    # fit: it is screened out before compiling.
    auto = kd.Auto(100_000, candidates=["data_parallel", "fsdp"], cache_dir=None)
    callback = kd.DistributeCallback(auto)
    model.fit(x, y, batch_size=8, shuffle=False, callbacks=[callback], verbose=2)
    choice = callback.choice
    result = {
        "description": choice.description,
        "code": choice.code,
        "peak": choice.peak_bytes,
        "devices": int(np.prod(callback.distribution.device_mesh.shape)),
        "weights": [float(np.sum(w)) for w in model.get_weights()],
        "line": choice.line,
    }
    with open(output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
