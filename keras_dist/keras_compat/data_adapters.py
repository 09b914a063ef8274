"""Keras' data adapters: how they shuffle, and how they shard per process.

Keras 3.15's adapters shard nothing themselves but tf.data, through
`Distribution.distribute_dataset`. Keras 3.16's shard every input per process
when the global distribution's `auto_shard_dataset` is true while they are
built (arrays, PyDataset and DataLoaders by whole batches, tf.data by
`rebatch` + `shard`). keras_dist splits each global batch itself (padding,
equal step counts), so its policies read `auto_shard_dataset` as False while
any Keras adapter is built (`keras_builds_data_adapter`): on both releases
Keras' adapters hand keras_dist the global data.

Keras 3.15 shuffles arrays from NumPy's (and torch's, TensorFlow's) global
generators; 3.16 from the adapter's own epoch counter (`_epoch`), the same on
every process whatever the generators hold (`shuffles_from_adapter_epoch`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def numpy_random_stream(stream: np.random.RandomState | None) -> Iterator[None]:
    """Make NumPy's global generator draw from `stream` inside the block.

    Keras 3.15's array adapter shuffles with `np.random.permutation` when an
    epoch's iterator starts; running it inside one stream seeded alike on
    every process gives every process the same global permutation, new each
    epoch.
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


# -- who is building an adapter ---------------------------------------------------
_in_keras_data_adapter = threading.local()


def keras_builds_data_adapter() -> bool:
    """Whether one of Keras' data adapters (built by `fit`/`evaluate`/
    `predict`) is being constructed: where Keras 3.15's `TFDatasetAdapter`
    calls `Distribution.distribute_dataset`, and where Keras 3.16's adapters
    read `auto_shard_dataset`, `num_data_shards` and `data_shard_id` to shard
    per process."""
    return getattr(_in_keras_data_adapter, "depth", 0) > 0


def _keras_data_adapter_classes() -> list[type]:
    """Every data adapter class Keras' `get_data_adapter` can build."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415
    from keras.src.trainers.data_adapters import data_adapter  # noqa: PLC0415

    return [
        value
        for value in vars(data_adapters).values()
        if inspect.isclass(value)
        and issubclass(value, data_adapter.DataAdapter)
        and value is not data_adapter.DataAdapter
    ]


def mark_keras_data_adapter() -> None:
    """Make `keras_builds_data_adapter()` true while any of Keras' data
    adapters is constructed (idempotent)."""
    for adapter_class in _keras_data_adapter_classes():
        original = adapter_class.__dict__.get("__init__")
        if original is None or getattr(original, "_keras_dist_marked", False):
            continue
        adapter_class.__init__ = _marked(original)


def _marked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def marked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_in_keras_data_adapter, "depth", 0)
        _in_keras_data_adapter.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _in_keras_data_adapter.depth = depth

    marked_init._keras_dist_marked = True  # type: ignore[attr-defined]
    return marked_init


def is_tf_dataset(value: Any) -> bool:
    """Whether `value` is a `tf.data.Dataset`, asked as Keras asks (without
    importing TensorFlow)."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415

    return data_adapters.is_tf_dataset(value)


# -- probes ----------------------------------------------------------------------
def _under_distribution(distribution: Any, build: Callable[[], Any]) -> Any:
    """`build()` with `distribution` as Keras' global distribution (set in
    Keras' global state directly: `set_distribution` would enter Keras 3.16's
    torch dispatch mode for a non-DataParallel one)."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    name = "distribution"
    saved = global_state.get_global_attribute(name)
    global_state.set_global_attribute(name, distribution)
    try:
        return build()
    finally:
        global_state.set_global_attribute(name, saved)


def _two_shard_distribution(auto_shard: Callable[[], bool]) -> Any:
    """Process 0 of a 2-process DataParallel job, as Keras' adapters ask it
    (`auto_shard_dataset`, `num_data_shards`, `data_shard_id`); never
    initialised (Keras' would list the devices)."""
    import keras  # noqa: PLC0415

    class TwoShards(keras.distribution.DataParallel):
        num_data_shards = 2
        data_shard_id = 0
        num_processes = 2
        num_model_replicas = 2
        _is_multi_process = False  # Keras 3.15 refuses arrays otherwise

        @property
        def auto_shard_dataset(self) -> bool:
            return auto_shard()

    return object.__new__(TwoShards)


def _batches_read(auto_shard: Callable[[], bool]) -> int:
    """How many of 4 batches Keras' array adapter, built under a 2-shard
    distribution, hands this process."""
    from keras.src.trainers.data_adapters import get_data_adapter  # noqa: PLC0415

    adapter = _under_distribution(
        _two_shard_distribution(auto_shard),
        lambda: get_data_adapter(np.zeros((8, 1)), batch_size=2),
    )
    return sum(1 for _ in adapter.get_numpy_iterator())


@functools.cache
def shards_inside_adapters() -> bool:
    """Whether Keras' adapters shard per process themselves when the global
    distribution says `auto_shard_dataset` (Keras 3.16)."""
    return _batches_read(lambda: True) == 2


def _check_sharding() -> list[str]:
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        tf_dataset_adapter,
    )

    missing = []
    init = tf_dataset_adapter.TFDatasetAdapter.__init__
    if "distribution" not in inspect.signature(init).parameters:
        missing.append("TFDatasetAdapter(dataset, distribution=...)")
    source = inspect.getsource(inspect.unwrap(init))
    # The switch keras_dist turns: the exact call of 3.15 (3.16's own
    # `self._distribute_dataset(` must not count), or 3.16's test.
    if (
        "distribution.distribute_dataset(" not in source
        and "distribution.auto_shard_dataset" not in source
    ):
        missing.append(
            "TFDatasetAdapter shards through distribution.distribute_dataset "
            "(<= 3.15) or only when distribution.auto_shard_dataset (3.16)"
        )
    if _batches_read(lambda: True) not in (2, 4):
        missing.append("ArrayDataAdapter reads all its batches or its shard's")
    # What keras_dist's policies do: False while the adapter is built.
    if _batches_read(lambda: not keras_builds_data_adapter()) != 4:
        missing.append(
            "Keras' data adapters do not shard when auto_shard_dataset reads "
            "False while they are built"
        )
    return missing


def check() -> list[str]:
    """What `Distribution.auto_shard_dataset` and `distribute_dataset` rely
    on, and how Keras' array adapter shuffles."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415

    missing = []
    if not callable(getattr(data_adapters, "is_tf_dataset", None)):
        missing.append("keras.src.trainers.data_adapters.is_tf_dataset")
    mark_keras_data_adapter()
    missing += _check_sharding()
    if not (_shuffle_follows_numpy_stream() or shuffles_from_adapter_epoch()):
        missing.append(
            "ArrayDataAdapter shuffles with NumPy's global generator (<= 3.15) "
            "or from its own epoch counter (3.16)"
        )
    return missing


def _first_batch_order(adapter: Any) -> list[int]:
    batch = next(iter(adapter.get_numpy_iterator()))
    return [int(value) for value in np.asarray(batch[0]).reshape(-1)]


def _shuffle_follows_numpy_stream() -> bool:
    from keras.src.trainers.data_adapters.array_data_adapter import (  # noqa: PLC0415
        ArrayDataAdapter,
    )

    def order(seed: int) -> list[int]:
        adapter = ArrayDataAdapter(np.arange(64)[:, None], batch_size=64, shuffle=True)
        with numpy_random_stream(np.random.RandomState(seed)):
            return _first_batch_order(adapter)

    return order(0) == order(0) != order(1)


@functools.cache
def shuffles_from_adapter_epoch() -> bool:
    """Whether Keras' array adapter draws each epoch's order from its own
    epoch counter (`_epoch`; Keras 3.16: `np.random.default_rng(epoch)`),
    whatever the global generators hold: then every process draws the same
    order without sharing random state, and a resumed epoch needs the
    counter set back (`epoch_iterator.watch_next_epoch_data`)."""
    from keras.src.trainers.data_adapters.array_data_adapter import (  # noqa: PLC0415
        ArrayDataAdapter,
    )

    def order(epoch: int, seed: int) -> list[int]:
        adapter = ArrayDataAdapter(np.arange(64)[:, None], batch_size=64, shuffle=True)
        if not hasattr(adapter, "_epoch"):
            return []
        adapter._epoch = epoch
        with numpy_random_stream(np.random.RandomState(seed)):
            return _first_batch_order(adapter)

    first = order(0, 0)
    return bool(first) and first == order(0, 1) != order(1, 0)


def adapter_epoch(data_adapter: Any) -> int | None:
    """The epoch counter `data_adapter` shuffles from (Keras 3.16), None on a
    Keras whose order comes from the global generators or an adapter without
    one."""
    value = getattr(data_adapter, "_epoch", None)
    if value is None or not shuffles_from_adapter_epoch():
        return None
    return int(value)


def set_adapter_epoch(data_adapter: Any, epoch: int) -> None:
    """Make `data_adapter` shuffle its next epoch as at epoch counter `epoch`
    (Keras 3.16; nothing on a Keras that shuffles from the generators)."""
    if shuffles_from_adapter_epoch() and hasattr(data_adapter, "_epoch"):
        data_adapter._epoch = int(epoch)
