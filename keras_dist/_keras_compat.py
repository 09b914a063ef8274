"""The backend-neutral Keras details keras_dist relies on, in one place.

`tests/test_keras_internals.py` checks each of them, so a Keras release that
moves one fails that test loudly instead of breaking users quietly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np

# Keras does not export the policies' base class; it is the common base of
# its DataParallel and ModelParallel.
KerasDistribution = keras.distribution.DataParallel.__mro__[1]


@contextlib.contextmanager
def numpy_random_stream(stream: np.random.RandomState | None) -> Iterator[None]:
    """Make NumPy's global generator draw from `stream` inside the block.

    Keras' array adapter shuffles with `np.random.permutation` when an epoch's
    iterator starts; running it inside one stream seeded alike on every process
    gives every process the same global permutation, new each epoch.
    """
    if stream is None:
        yield
        return
    saved = np.random.get_state()
    np.random.set_state(stream.get_state())
    try:
        yield
    finally:
        stream.set_state(np.random.get_state())
        np.random.set_state(saved)


def check() -> list[str]:
    """Names of the Keras details this release no longer matches."""
    missing = []
    if KerasDistribution.__name__ != "Distribution" or not issubclass(
        keras.distribution.ModelParallel, KerasDistribution
    ):
        missing.append("keras.distribution.DataParallel.__mro__[1] is Distribution")
    for name in (
        "scope",
        "get_data_layout",
        "get_variable_layout",
        "get_tensor_layout",
    ):
        if not hasattr(KerasDistribution, name):
            missing.append(f"Distribution.{name}")
    if not _shuffle_follows_numpy_stream():
        missing.append("ArrayDataAdapter shuffles with NumPy's global generator")
    return missing


def _shuffle_follows_numpy_stream() -> bool:
    from keras.src.trainers.data_adapters.array_data_adapter import (  # noqa: PLC0415
        ArrayDataAdapter,
    )

    def order(seed: int) -> list[int]:
        adapter = ArrayDataAdapter(np.arange(64)[:, None], batch_size=64, shuffle=True)
        with numpy_random_stream(np.random.RandomState(seed)):
            batch = next(iter(adapter.get_numpy_iterator()))
        return [int(value) for value in np.asarray(batch[0]).reshape(-1)]

    return order(0) == order(0) != order(1)
