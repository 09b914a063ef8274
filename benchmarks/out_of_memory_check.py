"""A model too large for one TPU v5e chip, fitted under keras_dist: the
error names what each device holds and what would fit, not only XLA's
buffers (`keras_dist.training.out_of_memory`): on JAX the failing step
compiled again for the chip, with the shortfall and the candidates that fit
there, each compiled (`keras_dist.planner.on_devices`).

    KERAS_BACKEND=jax python benchmarks/out_of_memory_check.py   # on the chip
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def main() -> None:
    import keras
    import numpy as np

    import keras_dist as kd
    from keras_dist.training.out_of_memory import OutOfDeviceMemoryError

    width = 40960  # 1.72 G parameters: 6.9 GB of weights, Adam's moments twice that
    model = keras.Sequential(
        [
            keras.Input((1024,)),
            keras.layers.Dense(width, activation="relu", name="up"),
            keras.layers.Dense(width, activation="relu", name="wide"),
            keras.layers.Dense(10, name="out"),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((64, 1024), "float32")
    y = np.zeros((64, 10), "float32")
    try:
        model.fit(
            x,
            y,
            batch_size=64,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    except OutOfDeviceMemoryError as error:
        print("OutOfDeviceMemoryError:\n" + str(error)[:4000])
        print("\ncaused by:", type(error.__cause__).__name__)
        return
    print("fit did not run out of memory")


if __name__ == "__main__":
    main()
