"""Quickstart: data-parallel training of a small convnet on simulated devices.

Trains on the 8x8 handwritten digits that scikit-learn ships (no download),
split over 8 simulated CPU devices with `keras_dist.DataParallel`, through a
plain `model.fit` and `keras_dist.DistributeCallback`.

    python examples/quickstart.py            # JAX, 8 simulated CPU devices
    KERAS_DIST_CPU_DEVICES=4 python examples/quickstart.py
    KERAS_BACKEND=jax python examples/quickstart.py --epochs 3
"""

from __future__ import annotations

import argparse
import os

# Both must be set before Keras and the backend start.
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_DIST_CPU_DEVICES", "8")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_dist as kd  # noqa: E402


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1)
    return train_test_split(
        images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_convnet",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=100, help="global batch")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    keras.utils.set_random_seed(arguments.seed)
    x_train, x_test, y_train, y_test = load_data(arguments.seed)

    distribution = kd.DataParallel()
    print(f"Backend: {keras.backend.backend()}")
    print(f"Devices: {kd.list_devices()}")
    print(f"Mesh:    {distribution.device_mesh}")
    print(
        f"Data:    {len(x_train)} training and {len(x_test)} test images, global "
        f"batch {arguments.batch_size}"
    )

    model = build_model()
    model.fit(
        x_train,
        y_train,
        batch_size=arguments.batch_size,
        epochs=arguments.epochs,
        validation_data=(x_test, y_test),
        callbacks=[kd.DistributeCallback(distribution)],
        verbose=1,
    )
    results = model.evaluate(
        x_test,
        y_test,
        batch_size=arguments.batch_size,
        callbacks=[kd.DistributeCallback(distribution)],
        verbose=0,
        return_dict=True,
    )
    print(
        f"Final test accuracy: {results['accuracy']:.4f} (loss {results['loss']:.4f})"
    )


if __name__ == "__main__":
    main()
