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
        own_predictions: `predict` returns this process' rows only (each
            process fed its own data) instead of every process' rows.
    """

    data: Any
    mask: Any
    global_rows: int
    padded_rows: int
    own_predictions: bool = False


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


class ProcessLocalRankBatches:
    """Iterator over one epoch when each process reads its own data.

    For `auto_shard_dataset=False`. The processes agree on every step's sizes
    (one small all-gather), pad their shares to the largest with masked rows and
    keep stepping with fully masked batches until every process has run out, so
    they all run the same number of steps and none waits forever.

    Args:
        batches: this process' batches from Keras' data adapter.
        device: where this process computes.
        gather_sizes: all-gathers `[rows, exhausted]` from every process.
    """

    def __init__(
        self,
        batches: Any,
        *,
        device: torch.device,
        gather_sizes: Callable[[np.ndarray], np.ndarray],
    ):
        self._batches = iter(batches)
        self._device = device
        self._gather_sizes = gather_sizes
        self._exhausted = False
        self._template: Any = None

    def __iter__(self) -> ProcessLocalRankBatches:
        return self

    def __next__(self) -> RankBatch:
        local = None
        if not self._exhausted:
            try:
                local = keras.tree.map_structure(_as_numpy, next(self._batches))
            except StopIteration:
                self._exhausted = True
        if local is not None and self._template is None:
            self._template = local
        size = 0 if local is None else leading_dim(local)
        sizes = self._gather_sizes(np.array([size, local is None], "int64"))
        if sizes[:, 1].all():
            raise StopIteration
        if self._template is None:
            raise ValueError(
                "This process has no data at all while others do; with "
                "auto_shard_dataset=False every process needs its part."
            )
        share = int(sizes[:, 0].max())
        if local is None:
            local = keras.tree.map_structure(
                lambda leaf: None if leaf is None else leaf[:0], self._template
            )

        def padded(leaf: Any) -> Any:
            if leaf is None:
                return None
            return torch.as_tensor(pad_rows(leaf, share - size), device=self._device)

        mask = np.zeros((share,), "float32")
        mask[:size] = 1.0
        return RankBatch(
            keras.tree.map_structure(padded, local),
            torch.as_tensor(mask, device=self._device),
            int(sizes[:, 0].sum()),
            share * len(sizes),
            own_predictions=True,
        )
