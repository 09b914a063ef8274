"""The model of `test_load_sharded` and its PyTorch worker: one wide kernel,
large enough that a full copy of it stands out next to a part of it."""

from __future__ import annotations

import keras


def wide_model() -> keras.Model:
    inputs = keras.Input((16,), name="features")
    hidden = keras.layers.Dense(2048, name="wide")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    return keras.Model(inputs, outputs, name="wide_model")
