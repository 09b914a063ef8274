"""How many rows each batch of an epoch holds, as Keras' data adapter knows it.

Keras' adapters for arrays (NumPy, tensors, DataFrames) cut `batch_size` rows
at a time, the last batch holding what is left; a torch `DataLoader` with a
sized sampler and a `batch_size` does the same (all full with `drop_last`); a
`tf.data.Dataset` whose batch dimension is static (`drop_remainder=True`)
holds exactly that many rows in every batch. For other inputs (a generator, a
`PyDataset`, a `tf.data.Dataset` whose last batch may be short) Keras does not
know the sizes before it reads the batches: `batch_plan` returns None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keras.src.trainers.data_adapters import (
    array_data_adapter,
    tf_dataset_adapter,
    torch_data_loader_adapter,
)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The rows of the batches an epoch's data iterator yields, in order.

    Attributes:
        batch_size: rows of every batch but the last.
        num_batches: batches in one pass; None when unknown or endless (every
            batch then holds `batch_size` rows).
        last_rows: rows of the last batch of a pass.
        input_type: what `fit` was given, for messages (e.g. "NumPy arrays").
    """

    batch_size: int
    num_batches: int | None
    last_rows: int
    input_type: str

    def rows(self, position: int) -> int:
        """Rows of the batch at `position` (0 for the first batch) of a pass;
        0 past its end."""
        if self.num_batches is None or position < self.num_batches - 1:
            return self.batch_size
        return self.last_rows if position == self.num_batches - 1 else 0


def input_type(data_adapter: Any) -> str:
    """What `fit` was given, in words, from Keras' adapter for it."""
    names = {
        "ArrayDataAdapter": "arrays",
        "TFDatasetAdapter": "a tf.data.Dataset",
        "TorchDataLoaderAdapter": "a torch DataLoader",
        "PyDatasetAdapter": "a keras.utils.PyDataset",
        "GeneratorDataAdapter": "a Python generator",
        "GrainDatasetAdapter": "a Grain dataset",
    }
    name = type(data_adapter).__name__
    return names.get(name, name)


def batch_plan(data_adapter: Any) -> BatchPlan | None:
    """The rows of each batch `data_adapter` yields, or None when it cannot
    say before reading them (see the module docstring)."""
    kind = input_type(data_adapter)
    if isinstance(data_adapter, array_data_adapter.ArrayDataAdapter):
        size, count = data_adapter.batch_size, data_adapter.num_batches
        if not (_positive_int(size) and _positive_int(count)):
            return None
        return BatchPlan(size, count, data_adapter.partial_batch_size or size, kind)
    if isinstance(data_adapter, torch_data_loader_adapter.TorchDataLoaderAdapter):
        return _data_loader_plan(data_adapter.get_torch_dataloader(), kind)
    if isinstance(data_adapter, tf_dataset_adapter.TFDatasetAdapter):
        try:
            size = data_adapter.batch_size  # the static batch dimension, or None
        except (IndexError, ValueError, TypeError):  # elements of rank 0
            return None
        if not _positive_int(size):
            return None
        count = data_adapter.num_batches
        return BatchPlan(size, count if _positive_int(count) else None, size, kind)
    return None


def _data_loader_plan(loader: Any, kind: str) -> BatchPlan | None:
    size = getattr(loader, "batch_size", None)
    if not _positive_int(size):
        return None  # a batch_sampler of the user's: sizes unknown
    try:
        rows = len(loader.sampler)
    except TypeError:
        return None  # an iterable dataset: no length
    if getattr(loader, "drop_last", False):
        count = rows // size
        return BatchPlan(size, count, size, kind) if count else None
    count = -(-rows // size)
    return BatchPlan(size, count, rows - (count - 1) * size, kind) if count else None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check() -> list[str]:
    """What `batch_plan` needs of Keras' adapters."""
    import numpy as np  # noqa: PLC0415

    missing = []
    adapter = array_data_adapter.ArrayDataAdapter(np.zeros((10, 1)), batch_size=4)
    try:
        plan = batch_plan(adapter)
    except AttributeError as error:
        plan = None
        missing.append(f"ArrayDataAdapter.{error.name}")
    if plan is not None and [plan.rows(i) for i in range(4)] != [4, 4, 2, 0]:
        missing.append(
            "ArrayDataAdapter's batch_size, num_batches and partial_batch_size"
        )
    for adapter_class in (
        tf_dataset_adapter.TFDatasetAdapter,
        torch_data_loader_adapter.TorchDataLoaderAdapter,
    ):
        for name in ("batch_size", "num_batches"):
            if not hasattr(adapter_class, name):
                missing.append(f"{adapter_class.__name__}.{name}")
    if not hasattr(
        torch_data_loader_adapter.TorchDataLoaderAdapter, "get_torch_dataloader"
    ):
        missing.append("TorchDataLoaderAdapter.get_torch_dataloader")
    return missing
