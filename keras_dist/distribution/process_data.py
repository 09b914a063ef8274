"""This process' part of a dataset, as Keras' `distribute_dataset` gives it
(`Distribution.distribute_dataset`, whose docstring says when)."""

from __future__ import annotations

from typing import Any

from keras_dist.keras_compat.data_adapters import (
    is_tf_dataset,
    keras_builds_data_adapter,
)


def process_part(distribution: Any, dataset: Any) -> Any:
    """`dataset` split as `distribution.distribute_dataset` documents."""
    if (
        keras_builds_data_adapter()
        or distribution._num_processes <= 1
        or not distribution.auto_shard_dataset
    ):
        return dataset
    if not is_tf_dataset(dataset):
        raise ValueError(
            "In a multi-process job `distribute_dataset` splits only a "
            "tf.data.Dataset between processes, as Keras does (inside `fit` "
            "keras_dist splits every input type itself). Pass a tf.data "
            "dataset, or set `auto_shard_dataset=False` if each process "
            f"already reads its own part. Received: {type(dataset).__name__}"
        )
    from keras_dist.backends.tensorflow import datasets  # noqa: PLC0415

    # As Keras splits it: one shard per model replica, at most one per
    # process (processes sharing a replica read the same part).
    replicas, processes = distribution.num_model_replicas, distribution._num_processes
    shard_id = distribution._process_id
    if replicas < processes:
        shard_id = distribution._process_id // (processes // replicas)
    return datasets.shard_batches(
        dataset, num_shards=min(replicas, processes), shard_id=shard_id
    )
