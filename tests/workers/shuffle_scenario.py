"""`fit(shuffle=...)` on a model whose result depends on the sample order.

Shared by `tests/test_shuffle_order.py` (plain Keras on one device, and
keras_dist in one process) and `shuffle_worker.py` (keras_dist in a real
multi-process job), so both train exactly the same thing.
"""

from __future__ import annotations

import random

import keras
import numpy as np
import worker_seed

SAMPLES = 37  # divides neither the batch nor the device or process counts
BATCH = 8
SEED = 21


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(9)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.normal(size=(SAMPLES, 1)).astype("float32")
    return x, y


class Batches(keras.utils.PyDataset):
    """The same data as a `PyDataset` (`fit(shuffle=True)` shuffles the order
    of its batches)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = data()

    def __len__(self) -> int:
        return -(-SAMPLES // BATCH)

    def __getitem__(self, index: int):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def model() -> keras.Model:
    """Plain SGD: the weights after an epoch depend on the batches' order."""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def fit_kwargs(kind: str) -> dict:
    """`fit` arguments for arrays with `shuffle=True`, `shuffle="batch"`, or a
    shuffled `PyDataset`."""
    if kind == "py_dataset":
        return {"x": Batches(), "shuffle": True}
    x, y = data()
    shuffle = {"arrays": True, "batch": "batch"}[kind]
    return {"x": x, "y": y, "batch_size": BATCH, "shuffle": shuffle}


def train(kind: str, callbacks: list) -> dict:
    """Seed, build, `fit` 2 epochs; the weights and the next draw of each global
    generator (they must have advanced exactly as in plain Keras)."""
    worker_seed.set_random_seed(SEED)
    trained = model()
    trained.fit(**fit_kwargs(kind), epochs=2, verbose=0, callbacks=callbacks)
    return {
        "weights": [w.tolist() for w in trained.get_weights()],
        "next_draws": next_draws(),
    }


def next_draws() -> list[float]:
    """The next value of NumPy's, Python's (and torch's) global generators."""
    draws = [float(np.random.random()), random.random()]
    if keras.backend.backend() == "torch":
        import torch  # noqa: PLC0415

        draws.append(float(torch.rand(())))
    return draws
