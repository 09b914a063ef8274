"""PyTorch input pipeline: each process' rows of every global batch.

Every process reads the same global batches (the input as `fit` received it),
pads a batch the processes cannot split evenly, and keeps its own block of rows,
as torch's `DistributedSampler` gives each rank its share; the padding is masked.

A torch `DataLoader` over a map-style dataset with an ordinary sampler goes
further (`ShardedLoader`): each process loads only its own rows of each global
batch, through a copy of the loader that keeps its collate_fn, workers and
pinning. Other loaders (an `IterableDataset`, a custom `batch_sampler` or
sampler) are read whole by every process, which keeps its rows (`RankBatches`):
correct, but every process does all the loading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import torch

from keras_dist.common.job import warn_once
from keras_dist.common.padding import fingerprint, leading_dim, pad_rows, padded_size


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
        share_random_streams: called before the epoch's first batch, in a
            multi-process job: every process takes process 0's global random
            generators, so Keras' shuffling draws the same order everywhere
            (`keras_dist.random_streams`). None in one process.
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
        share_random_streams: Callable[[], None] | None = None,
        check_same_input: Callable[[int], None] | None = None,
    ):
        self._batches = batches
        self._iterator: Iterator[Any] | None = None
        self._world_size = world_size
        self._rank = rank
        self._device = device
        self._share_random_streams = share_random_streams
        self._check_same_input = check_same_input

    def __iter__(self) -> RankBatches:
        # When Keras asks, as without keras_dist: making a DataLoader's
        # iterator draws from torch's generator.
        self._start()
        return self

    def _start(self) -> None:
        if self._iterator is None:
            if self._share_random_streams is not None:
                self._share_random_streams()
            self._iterator = iter(self._batches)

    def _to_device(self, leaf: Any) -> Any:
        if leaf is None:
            return None
        if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
            # torch would share a read-only buffer (and warn): a copy instead.
            leaf = leaf.copy()
        return torch.as_tensor(leaf, device=self._device)

    def __next__(self) -> RankBatch:
        self._start()
        batch = next(self._iterator)
        if self._check_same_input is None:
            rank_batch = self._tensor_rows(batch)
            if rank_batch is not None:
                return rank_batch
        batch = keras.tree.map_structure(_as_numpy, batch)
        if self._check_same_input is not None:
            check, self._check_same_input = self._check_same_input, None
            check(fingerprint(batch))
        return self._array_rows(batch)

    def _tensor_rows(self, batch: Any) -> RankBatch | None:
        """This process' rows of a batch of torch tensors (Keras' own
        DataLoader gives `(x, y)` or `(x, y, sample_weight)` tuples of them),
        sliced in torch, when the processes split it evenly; None otherwise.
        The same rows as `_array_rows`, without its round trip through NumPy
        and walks of the nested structure (about 0.3 ms a step, 1 % of the
        benchmarks' small MLP step on two CPU processes)."""
        if type(batch) is not tuple:
            return None
        size = None
        for leaf in batch:
            if leaf is None:
                continue
            if not isinstance(leaf, torch.Tensor) or not leaf.ndim:
                return None
            if size is None:
                size = int(leaf.shape[0])
        if size is None or size % self._world_size:
            return None
        share = size // self._world_size
        start = self._rank * share
        return RankBatch(
            tuple(
                None
                if leaf is None
                else leaf.detach()[start : start + share].to(self._device)
                for leaf in batch
            ),
            torch.ones((share,), dtype=torch.float32, device=self._device),
            size,
            size,
        )

    def _array_rows(self, batch: Any) -> RankBatch:
        size = leading_dim(batch)
        padded = padded_size(size, self._world_size)
        share = padded // self._world_size
        rows = slice(self._rank * share, (self._rank + 1) * share)

        def mine(leaf: Any) -> Any:
            if leaf is None:
                return None
            if padded != size:
                leaf = pad_rows(leaf, padded - size)
            return self._to_device(leaf[rows])

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


# -- torch DataLoader: each process loads its own rows -------------------------
_LOADS_EVERYTHING = (
    "keras_dist cannot split this torch DataLoader between processes ({reason}), "
    "so every process loads every batch and keeps its own rows: the training is "
    "right but each process does all the loading. A map-style dataset with "
    "`batch_size` and `shuffle` (no custom sampler or batch_sampler) lets each "
    "process load only its own samples."
)


def reshard_refusal(loader: torch.utils.data.DataLoader) -> str | None:
    """Why each process cannot load only its own rows of `loader`; None if it can.

    It can when the loader batches a map-style dataset with torch's own
    `BatchSampler` over a `SequentialSampler` or a `RandomSampler` without
    replacement that draws every sample once.
    """
    data = torch.utils.data
    dataset = loader.dataset
    if isinstance(dataset, data.IterableDataset):
        return "its dataset is an IterableDataset"
    try:
        len(dataset)
    except TypeError:
        return "its dataset has no length"
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return "it does not batch (batch_size=None)"
    if type(batch_sampler) is not data.BatchSampler:
        return f"it has a custom batch_sampler, {type(batch_sampler).__name__}"
    sampler = batch_sampler.sampler
    if type(sampler) is data.RandomSampler:
        if sampler.replacement or sampler.num_samples != len(dataset):
            return "its RandomSampler does not draw every sample exactly once"
    elif type(sampler) is not data.SequentialSampler:
        return f"it has a custom sampler, {type(sampler).__name__}"
    if getattr(sampler, "data_source", dataset) is not dataset:
        return "its sampler draws from another dataset"
    if getattr(loader, "in_order", True) is False:
        return "it has in_order=False"
    return None


def _loader_row(loader: torch.utils.data.DataLoader, refusal: str | None) -> list:
    """`[shardable, samples, batch_size, drop_last, shuffle]` of a loader."""
    if refusal is not None:
        return [0, -1, loader.batch_size or -1, int(loader.drop_last), -1]
    batch_sampler = loader.batch_sampler
    return [
        1,
        len(loader.dataset),
        batch_sampler.batch_size,
        int(batch_sampler.drop_last),
        int(type(batch_sampler.sampler) is torch.utils.data.RandomSampler),
    ]


def _check_loaders_agree(rows: np.ndarray) -> None:
    """Raise unless every process (a row of `rows`) has the same kind of loader."""
    if (rows[:, :5] == rows[0, :5]).all():
        return
    described = "; ".join(
        f"process {rank}: "
        + (
            "a loader it cannot split"
            if not row[0]
            else f"{row[1]} samples, batch_size={row[2]}, drop_last="
            f"{bool(row[3])}, shuffle={bool(row[4])}"
        )
        for rank, row in enumerate(rows.tolist())
    )
    raise ValueError(
        "Every process must give `fit` the same torch DataLoader (same dataset "
        "length, batch_size, drop_last and shuffle), or the processes would run "
        f"different numbers of steps. Received: {described}"
    )


def shard_loader(
    loader: torch.utils.data.DataLoader,
    *,
    world_size: int,
    rank: int,
    device: torch.device,
    gather: Callable[[np.ndarray], np.ndarray] | None,
) -> ShardedLoader | None:
    """A `ShardedLoader` for `loader`, or None when it cannot be split.

    Collective when `world_size > 1`: every process calls it for the same
    loader; they check that their loaders agree and take process 0's shuffle
    seed (drawn from the sampler's generator, or torch's global one, as
    `RandomSampler` does).
    """
    refusal = reshard_refusal(loader)
    row = _loader_row(loader, refusal)
    seed = 0
    if refusal is None and row[4]:
        generator = loader.batch_sampler.sampler.generator
        seed = int(torch.randint(0, 2**62, (), generator=generator).item())
    if world_size > 1:
        if gather is None:
            raise ValueError("`gather` is needed when world_size > 1")
        rows = gather(np.array([*row, seed], "int64"))
        _check_loaders_agree(rows)
        seed = int(rows[0, 5])
    if refusal is not None:
        if world_size > 1:
            warn_once(_LOADS_EVERYTHING.format(reason=refusal), UserWarning)
        return None
    return ShardedLoader(
        loader, seed=seed, world_size=world_size, rank=rank, device=device
    )


class _Step(NamedTuple):
    """One global batch as this process sees it."""

    global_rows: int  # real rows over all processes
    real_rows: int  # this process' real rows
    loads: bool  # False: no rows here, zero rows built from the template


class _PlannedBatches:
    """The per-process loader's batch_sampler: this pass' index lists."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        # Captured when the loader's iterator starts, before it prefetches.
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


class ShardedLoader:
    """A torch DataLoader split between processes, `DistributedSampler`-style.

    The loader's `batch_size` is the global batch. Each pass over the data
    (epoch) orders the samples as one process would (in order, or a
    permutation drawn from `seed + epoch`, the same on every process: the epoch
    is set automatically, as `DistributedSampler.set_epoch` would be), cuts
    global batches from that order (dropping an incomplete last one with
    `drop_last`), and loads only this process' block of each, through a
    DataLoader that keeps the original's dataset, collate_fn, workers, pinning
    and generator. A global batch that does not divide the processes is padded
    with masked zero rows, so each sample counts exactly once per epoch.

    A process with no real rows in a batch builds its zero rows from the
    shape of its earlier batches; only when it has none yet does it load the
    batch's first sample to learn the shape (and masks it out).

    Args:
        loader: the DataLoader `fit` received (see `reshard_refusal`).
        seed: the shuffle seed, equal on every process.
        world_size: processes in the job.
        rank: this process.
        device: where this process computes.
    """

    def __init__(
        self,
        loader: torch.utils.data.DataLoader,
        *,
        seed: int,
        world_size: int,
        rank: int,
        device: torch.device,
    ):
        batch_sampler = loader.batch_sampler
        self._samples = len(loader.dataset)
        self._batch_size = batch_sampler.batch_size
        self._drop_last = batch_sampler.drop_last
        self._shuffle = type(batch_sampler.sampler) is torch.utils.data.RandomSampler
        self._seed = seed
        self._world_size = world_size
        self._rank = rank
        self._device = device
        self._epoch = 0  # passes over the data completed so far
        self._template: Any = None  # this process' rows with zero rows
        self._plan = _PlannedBatches()
        options = {}
        if hasattr(loader, "in_order"):
            options["in_order"] = True
        if getattr(loader, "pin_memory_device", ""):
            options["pin_memory_device"] = loader.pin_memory_device
        self._loader = torch.utils.data.DataLoader(
            loader.dataset,
            batch_sampler=self._plan,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            **options,
        )

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices of pass `epoch`, as one process would read them."""
        if not self._shuffle:
            return np.arange(self._samples)
        generator = torch.Generator()
        generator.manual_seed(self._seed + epoch)
        return torch.randperm(self._samples, generator=generator).numpy()

    def _start_pass(self) -> list[_Step]:
        order = self.order(self._epoch)
        steps, loads = [], []
        has_shape = self._template is not None
        for start in range(0, self._samples, self._batch_size):
            rows = order[start : start + self._batch_size]
            if len(rows) < self._batch_size and self._drop_last:
                break
            share = -(-len(rows) // self._world_size)
            mine = rows[self._rank * share : (self._rank + 1) * share]
            step = _Step(len(rows), len(mine), loads=len(mine) > 0 or not has_shape)
            if step.loads:
                # With no rows and no shape yet, load one sample for its shape.
                loads.append([int(i) for i in (mine if len(mine) else rows[:1])])
                has_shape = True
            steps.append(step)
        self._plan.batches = loads
        return steps

    def epoch(self) -> Iterator[RankBatch]:
        """This process' batches of the next pass; starts loading when first read."""
        return _ShardedEpoch(self)

    def _finish_pass(self) -> None:
        self._epoch += 1

    def _rank_batch(self, step: _Step, loaded: Any) -> RankBatch:
        if step.loads:
            if not isinstance(loaded, (list, tuple)):
                loaded = (loaded,)
            data = keras.tree.map_structure(
                lambda leaf: (
                    None if leaf is None else torch.as_tensor(leaf)[: step.real_rows]
                ),
                tuple(loaded),
            )
            if self._template is None:
                self._template = keras.tree.map_structure(
                    lambda leaf: None if leaf is None else leaf[:0], data
                )
        else:
            data = self._template
        share = -(-step.global_rows // self._world_size)

        def place(leaf: Any) -> Any:
            if leaf is None:
                return None
            leaf = leaf.to(self._device, non_blocking=True)
            if share > leaf.shape[0]:
                zeros = leaf.new_zeros((share - leaf.shape[0], *leaf.shape[1:]))
                leaf = torch.cat([leaf, zeros])
            return leaf

        mask = torch.zeros((share,), dtype=torch.float32)
        mask[: step.real_rows] = 1.0
        return RankBatch(
            keras.tree.map_structure(place, data),
            mask.to(self._device),
            step.global_rows,
            share * self._world_size,
        )


class _ShardedEpoch:
    """One pass of a `ShardedLoader`; plans and starts loading when first read."""

    def __init__(self, owner: ShardedLoader):
        self._owner = owner
        self._steps: list[_Step] | None = None
        self._batches: Iterator[Any] = iter(())
        self._position = 0

    def __iter__(self) -> _ShardedEpoch:
        return self

    def __next__(self) -> RankBatch:
        owner = self._owner
        if self._steps is None:
            self._steps = owner._start_pass()
            if not self._steps:
                owner._finish_pass()
            elif any(step.loads for step in self._steps):
                self._batches = iter(owner._loader)
        if self._position >= len(self._steps):
            raise StopIteration
        step = self._steps[self._position]
        self._position += 1
        if self._position == len(self._steps):
            # Keras does not ask past the last batch; the pass ends here.
            owner._finish_pass()
        return owner._rank_batch(step, next(self._batches) if step.loads else None)
