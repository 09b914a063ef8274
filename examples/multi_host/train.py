"""Multi-host data-parallel training: the same script runs in every process.

Each process joins the job with `keras_dist.initialize()` (the launcher, torchrun,
SLURM or the KERAS_DISTRIBUTION_* variables say where the coordinator is), reads
the same data, and `fit` gives each process its share of every global batch.
Process 0 prints the progress and writes the CSV log; all processes end with the
same weights and the same metrics.

See README.md beside this file for the launch commands.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras_dist as kd  # noqa: E402  (configures simulated devices first)

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description="multi-host data parallel training")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch")
    parser.add_argument("--log", default="training_log.csv")
    arguments = parser.parse_args()

    keras.utils.set_random_seed(0)  # the same on every process
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target
    print(
        f"process {kd.process_id()} of {kd.num_processes()}: "
        f"{kd.get_device_count()} devices in the job"
    )

    distribution = kd.DataParallel()
    model = build_model()
    history = model.fit(
        x,
        y,
        batch_size=arguments.batch_size,
        epochs=arguments.epochs,
        validation_split=0.2,
        callbacks=[
            kd.DistributeCallback(distribution),
            keras.callbacks.CSVLogger(arguments.log),
        ],
    )
    checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
    print(
        f"process {kd.process_id()}: final val_accuracy "
        f"{history.history['val_accuracy'][-1]:.4f}, weight checksum {checksum:.6f}"
    )


if __name__ == "__main__":
    main()
