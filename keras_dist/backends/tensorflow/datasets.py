"""A `tf.data.Dataset` of global batches split between processes.

What `Distribution.distribute_dataset` does when called directly, on any
Keras backend (tf.data feeds JAX and PyTorch too): each global batch is
rebatched into one piece per data shard and every process keeps its own
(`rebatch` + `shard`), as Keras splits it (Keras 3.15's
`Distribution.distribute_tf_dataset`, 3.16's `TFDatasetAdapter`). keras_dist
does it itself, so it depends on neither place.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.data.experimental.ops import distribute as tf_distribute


def shard_batches(dataset: Any, *, num_shards: int, shard_id: int) -> Any:
    """Shard `shard_id`'s part of every global batch of `dataset`: batch `b`
    rows become `b / num_shards` rows per shard, shard `i` keeping the `i`-th
    block. One shard: `dataset` itself.

    Raises:
        ValueError: when the batch size is unknown (not batched) or
            `num_shards` does not divide it.
    """
    if num_shards <= 1:
        return dataset
    unknown = (
        "distribute_dataset splits each global batch between the processes, "
        "so it needs a batched dataset with a known batch size, e.g. "
        "`dataset.batch(batch_size)`."
    )
    specs = tf.nest.flatten(dataset.element_spec)
    if not all(getattr(spec, "shape", None) is not None for spec in specs) or any(
        spec.shape.rank in (None, 0) for spec in specs
    ):
        raise ValueError(f"{unknown} Received: element_spec={dataset.element_spec}")
    global_batch = int(tf_distribute.compute_batch_size(dataset).numpy())
    if global_batch < 0:
        raise ValueError(f"{unknown} Received: a dataset whose batch size is unknown")
    if global_batch % num_shards:
        raise ValueError(
            f"distribute_dataset splits each global batch into {num_shards} "
            f"equal parts (one per data shard), which a batch of {global_batch} "
            "rows does not divide. Batch the dataset by a multiple of "
            f"{num_shards}. Received: batch size {global_batch}"
        )
    pieces = dataset.rebatch(global_batch // num_shards)
    return pieces.shard(num_shards, shard_id).prefetch(tf.data.AUTOTUNE)
