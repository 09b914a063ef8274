"""The MLP and synthetic data the data-parallel benchmark entries share."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np

GLOBAL_BATCH = 512
FEATURES = 256
HIDDEN = 512
CLASSES = 10
SEED = 1234


def build_model(
    *, metrics: tuple[str, ...] = ("accuracy",), jit_compile: bool | str = "auto"
) -> keras.Model:
    """The MLP, compiled with Adam, sparse cross-entropy on logits, `metrics`
    and `jit_compile`."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
        jit_compile=jit_compile,
    )
    return model


def synthetic_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(rows,)).astype("int32")
    return x, y


def describe(model: keras.Model) -> str:
    params = model.count_params()
    return f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, {params:,} params, Adam"


def fit_steps(
    model: keras.Model,
    x: np.ndarray,
    y: np.ndarray,
    own_callbacks: Callable[[], list] = list,
    *,
    batch_size: int = GLOBAL_BATCH,
) -> Callable[[int, list], keras.callbacks.History]:
    """A candidate's `fit(steps, callbacks)`: `steps` global batches of `x, y`,
    in order, with `own_callbacks()` ahead of the harness' callbacks."""

    def fit(steps: int, callbacks: list) -> keras.callbacks.History:
        rows = steps * batch_size
        return model.fit(
            x[:rows],
            y[:rows],
            batch_size=batch_size,
            shuffle=False,
            verbose=0,
            callbacks=[*own_callbacks(), *callbacks],
        )

    return fit
