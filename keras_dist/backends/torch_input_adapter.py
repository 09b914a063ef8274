"""PyTorch input pipeline: each process' rows of every global batch.

Every process reads the same global batches (the input as `fit` received it),
pads a batch the processes cannot split evenly, and keeps its own block of rows,
as torch's `DistributedSampler` gives each rank its share; the padding is masked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import torch

from keras_dist._keras_compat import numpy_random_stream
from keras_dist.padding import fingerprint, leading_dim, pad_rows, padded_size


class RankBatch(NamedTuple):
    """This process' rows of one global batch.

    Attributes:
        data: the `(x,)`, `(x, y)` or `(x, y, sample_weight)` rows of this rank.
        mask: float32 vector, 1 for real rows and 0 for padding.
        global_rows: real rows in the global batch, over all processes.
        padded_rows: rows of the padded global batch (every rank holds an equal
            share of them).
    """

    data: Any
    mask: Any
    global_rows: int
    padded_rows: int


def _as_numpy(leaf: Any) -> Any:
    if leaf is None:
        return None
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


class RankBatches:
    """Iterator over one epoch's batches for one process.

    Args:
        batches: the global batches from Keras' data adapter.
        world_size: processes in the job.
        rank: this process.
        device: where this process computes.
        shuffle_stream: NumPy stream Keras' shuffling draws from, seeded alike on
            every process.
        check_same_input: called with the first batch's fingerprint; raises when
            the processes read different data.
    """

    def __init__(
        self,
        batches: Any,
        *,
        world_size: int,
        rank: int,
        device: torch.device,
        shuffle_stream: np.random.RandomState,
        check_same_input: Callable[[int], None] | None = None,
    ):
        self._batches = batches
        self._iterator: Iterator[Any] | None = None
        self._world_size = world_size
        self._rank = rank
        self._device = device
        self._shuffle_stream = shuffle_stream
        self._check_same_input = check_same_input

    def __iter__(self) -> RankBatches:
        return self

    def _to_device(self, leaf: Any) -> Any:
        if leaf is None:
            return None
        return torch.as_tensor(leaf, device=self._device)

    def __next__(self) -> RankBatch:
        with numpy_random_stream(self._shuffle_stream):
            if self._iterator is None:
                self._iterator = iter(self._batches)
            batch = next(self._iterator)
        batch = keras.tree.map_structure(_as_numpy, batch)
        if self._check_same_input is not None:
            check, self._check_same_input = self._check_same_input, None
            check(fingerprint(batch))
        size = leading_dim(batch)
        padded = padded_size(size, self._world_size)
        share = padded // self._world_size
        rows = slice(self._rank * share, (self._rank + 1) * share)

        def mine(leaf: Any) -> Any:
            if leaf is None:
                return None
            return self._to_device(pad_rows(leaf, padded - size)[rows])

        mask = np.zeros((padded,), "float32")
        mask[:size] = 1.0
        return RankBatch(
            keras.tree.map_structure(mine, batch),
            self._to_device(mask[rows]),
            size,
            padded,
        )
