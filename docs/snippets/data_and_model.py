"""What the docs' examples take as given: `x`, `y` and `build_model()`.

A code block marked `<!-- run-with: snippets/data_and_model.py -->` runs after
this file, in the same script (`tests/test_docs_code_blocks.py`). Your own
data and model take their place; these are small so that every block runs in
seconds on CPU.
"""

import keras
import numpy as np

import keras_dist as kd  # noqa: F401  (the blocks use it)

keras.utils.set_random_seed(0)
x = np.random.rand(512, 16).astype("float32")
y = np.random.randint(0, 10, size=(512,))


def build_model() -> keras.Model:
    """A small classifier; its first layer is named `dense`."""
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="dense"),
            keras.layers.Dense(10, activation="softmax", name="head"),
        ]
    )
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


model = build_model()
