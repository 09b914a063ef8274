"""Keras' data adapters: how they shuffle, and who calls `distribute_dataset`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from keras_dist.keras_compat.distribution import KerasDistribution


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


# -- `Distribution.distribute_dataset`: Keras' data adapter or a direct call ------
_in_keras_data_adapter = threading.local()


def keras_builds_data_adapter() -> bool:
    """Whether Keras' tf.data adapter (built by `fit`/`evaluate`/`predict`) is
    running, the one caller of `Distribution.distribute_dataset` in Keras."""
    return getattr(_in_keras_data_adapter, "depth", 0) > 0


def mark_keras_data_adapter() -> None:
    """Make `keras_builds_data_adapter()` true while Keras' `TFDatasetAdapter`
    is built (idempotent)."""
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        tf_dataset_adapter,
    )

    adapter_class = tf_dataset_adapter.TFDatasetAdapter
    original = adapter_class.__init__
    if getattr(original, "_keras_dist_marked", False):
        return

    @functools.wraps(original)
    def marked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_in_keras_data_adapter, "depth", 0)
        _in_keras_data_adapter.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _in_keras_data_adapter.depth = depth

    marked_init._keras_dist_marked = True  # type: ignore[attr-defined]
    adapter_class.__init__ = marked_init


def is_tf_dataset(value: Any) -> bool:
    """Whether `value` is a `tf.data.Dataset`, asked as Keras asks (without
    importing TensorFlow)."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415

    return data_adapters.is_tf_dataset(value)


def check() -> list[str]:
    """What `Distribution.distribute_dataset` relies on, and how Keras' array
    adapter shuffles."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        tf_dataset_adapter,
    )

    missing = []
    if not callable(getattr(data_adapters, "is_tf_dataset", None)):
        missing.append("keras.src.trainers.data_adapters.is_tf_dataset")
    init = tf_dataset_adapter.TFDatasetAdapter.__init__
    if "distribution" not in inspect.signature(init).parameters:
        missing.append("TFDatasetAdapter(dataset, distribution=...)")
    source = inspect.getsource(inspect.unwrap(init))
    if "distribute_dataset" not in source:
        missing.append("TFDatasetAdapter calls distribution.distribute_dataset")
    for name in ("distribute_tf_dataset", "data_shard_id", "num_processes"):
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
