"""TensorFlow input pipeline: each replica's rows of every global batch.

Keras turns every input type into a `tf.data.Dataset` of global batches. These
functions extend that dataset, inside tf.data, so that each batch is padded to
a size the replicas divide, this worker keeps its contiguous block of rows and
that block is cut into one piece per local replica, each with a mask (1 for
real rows) and the loss scale the masked steps need. `tf.distribute` hands the
pieces to the replicas in order (`distribute_datasets_from_function`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_dist.backends.tensorflow.iterator_reaper import REAPER
from keras_dist.keras_compat.data_adapters import numpy_random_stream

#: Keys of the elements the replicas receive.
DATA, MASK, SCALE = "data", "mask", "scale"


def _check_dense(element_spec: Any) -> None:
    for spec in tf.nest.flatten(element_spec):
        if not isinstance(spec, tf.TensorSpec):
            raise NotImplementedError(
                "keras_dist pads and splits dense batches; ragged and sparse "
                f"inputs are not supported on TensorFlow yet. Received: {spec}. "
                "Densify them in the dataset (e.g. `.to_tensor()`)."
            )


def split_global_batches(
    dataset: tf.data.Dataset,
    *,
    num_replicas: int,
    num_workers: int,
    worker_index: int,
) -> tf.data.Dataset:
    """Turn a dataset of global batches into this worker's per-replica pieces.

    Each global batch of `n` rows is padded with zero rows to `p`, the next
    multiple of `num_replicas`; worker `w` keeps rows `[w * p / W, (w + 1) * p /
    W)` and yields them as `num_replicas / W` consecutive elements, one per
    local replica, each `{DATA: rows, MASK: 1 or 0 per row, SCALE: p / n}`.
    """
    _check_dense(dataset.element_spec)
    local_replicas = num_replicas // num_workers

    def split(*element: Any) -> dict[str, Any]:
        # tf.data passes a tuple element's parts as arguments: `element` is
        # the element as a tuple, Keras' packing kept (a predict input that
        # is itself a tuple, `((x1, x2),)`, stays one input).
        data = element
        leaves = tf.nest.flatten(data)
        rows = tf.shape(leaves[0], out_type=tf.int64)[0]
        padded = (rows + num_replicas - 1) // num_replicas * num_replicas
        share = padded // num_workers
        start = worker_index * share
        piece = share // local_replicas

        def mine(leaf: tf.Tensor) -> tf.Tensor:
            padding = [[0, padded - rows]] + [[0, 0]] * (len(leaf.shape) - 1)
            # A gather, not a slice: the pieces get buffers of their own. A
            # slice (and a pad by zero rows) hands on the source's buffer, which
            # for a Python input (PyDataset, `from_generator`) can be the user's
            # own NumPy array; a step op that then reuses its input's buffer
            # (`y - y_pred`) wrote into that array, changing the data of the
            # epochs after.
            block = tf.gather(tf.pad(leaf, padding), tf.range(start, start + share))
            return tf.reshape(
                block, tf.concat([[local_replicas, piece], tf.shape(leaf)[1:]], 0)
            )

        mask = tf.cast(tf.range(padded) < rows, tf.float32)
        scale = tf.cast(padded, tf.float32) / tf.cast(rows, tf.float32)
        return {
            DATA: tf.nest.map_structure(mine, data),
            MASK: mine(mask),
            SCALE: tf.fill([local_replicas], scale),
        }

    pieces = dataset.map(split, num_parallel_calls=tf.data.AUTOTUNE)
    return pieces.flat_map(tf.data.Dataset.from_tensor_slices).prefetch(
        tf.data.AUTOTUNE
    )


def numpy_batches_dataset(
    data_adapter: Any, shuffle_stream: np.random.RandomState
) -> tf.data.Dataset:
    """The adapter's global batches, with Keras' NumPy shuffling drawn from
    `shuffle_stream` (seeded alike on every worker), as a `tf.data.Dataset`.

    Used in multi-worker jobs for inputs Keras shuffles itself: every worker
    must see the same global batches in the same order.
    """
    spec = data_adapter.get_tf_dataset().element_spec

    def generate() -> Iterator[Any]:
        with numpy_random_stream(shuffle_stream):
            iterator = iter(data_adapter.get_numpy_iterator())
        while True:
            with numpy_random_stream(shuffle_stream):
                batch = next(iterator, None)
            if batch is None:
                return
            yield keras.tree.lists_to_tuples(batch)

    return tf.data.Dataset.from_generator(generate, output_signature=spec)


def distributed_batches(
    strategy: tf.distribute.Strategy,
    dataset: tf.data.Dataset,
    *,
    num_workers: int,
    worker_index: int,
) -> Any:
    """The distributed dataset whose replicas get their pieces of each batch."""

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        return split_global_batches(
            dataset,
            num_replicas=strategy.num_replicas_in_sync,
            num_workers=num_workers,
            worker_index=worker_index,
        )

    return _Reaped(strategy.distribute_datasets_from_function(dataset_fn))


class _Reaped:
    """A distributed dataset whose iterators are destroyed off the training
    thread once Keras drops them (see `iterator_reaper`)."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset

    def __iter__(self) -> Any:
        return REAPER.adopt(iter(self._dataset))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dataset, name)
