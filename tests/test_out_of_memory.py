"""A distributed call that runs out of device memory ends with a plan
(`keras_dist.training.out_of_memory`). The engines' out-of-memory errors need
an accelerator (`benchmarks/out_of_memory_check.py` shows one on a TPU
chip); here a layer raises the words XLA uses, as the engine would from
inside the step."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.training.out_of_memory import OutOfDeviceMemoryError


class Exhausting(keras.layers.Layer):
    """Raises what the engine raises when a buffer does not fit (or another
    error), from inside the train step."""

    def __init__(self, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def call(self, inputs, training=None):
        if training:
            raise RuntimeError(self.message)
        return inputs


def _model(message: str) -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(256, name="wide"),
            Exhausting(message),
            keras.layers.Dense(4, name="out"),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def _fit(model: keras.Model, callbacks: list) -> None:
    x = np.zeros((8, 16), "float32")
    y = np.zeros((8, 4), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)


OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes."


def test_an_out_of_memory_error_names_the_largest_variables_and_what_would_fit():
    model = _model(OOM)
    distribution = kd.DataParallel()
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(model, [kd.DistributeCallback(distribution)])
    message = str(raised.value)
    assert message.startswith("fit ran out of device memory under")
    assert "wide/kernel (16, 256)" in message, message  # the largest first
    assert "gradients" in message and "optimizer slots" in message
    for candidate in ("kd.DataParallel()", "kd.FSDP()", 'kd.FSDP(remat="full")'):
        assert candidate in message
    assert "keras_dist.plan_search" in message
    assert OOM in message and isinstance(raised.value.__cause__, RuntimeError)
    # The run ended with the call: the model trains again afterwards.
    assert keras.distribution.distribution() is None


def test_other_errors_and_plain_keras_are_left_as_they_are():
    with pytest.raises(RuntimeError, match="something else"):
        _fit(_model("something else"), [kd.DistributeCallback(kd.DataParallel())])
    # Without keras_dist's callback the engine's error reaches the user as is.
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as raised:
        _fit(_model(OOM), [])
    assert not isinstance(raised.value, OutOfDeviceMemoryError)
