"""JAX input pipeline: global batches laid out as process-spanning arrays.

Keras' data adapters yield batches; these iterators pad them to a size the
batch shards divide (masking the padding), keep the rows of this process'
devices and build global `jax.Array`s from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_dist.common.padding import (
    MaskedBatch,
    check_same_input,
    fingerprint,
    leading_dim,
    pad_batch,
    pad_rows,
    padded_size,
)
from keras_dist.common.prefetch import Prefetcher
from keras_dist.keras_compat.epoch_iterator import single_batches


def _process_rows(sharding: Any, global_shape: tuple[int, ...]) -> slice:
    """The rows of a global batch that live on this process' devices."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(global_shape[0])
        starts.append(start)
        stops.append(stop)
    rows = slice(min(starts), max(stops))
    covered = {r for a, b in zip(starts, stops, strict=True) for r in range(a, b)}
    if len(covered) != rows.stop - rows.start:
        raise ValueError(
            "keras_dist needs each process' devices to hold a contiguous block of "
            "the batch; order the mesh devices by process. Received: a mesh whose "
            f"rows for process {jax.process_index()} are {sorted(covered)}"
        )
    return rows


# The shapes and dtypes of the last global batch laid out in this process
# (before padding), for the plan of a call that ran out of memory.
_last_batch: list[Any] = []


def last_batch_shapes() -> Any:
    """The last global batch laid out since `forget_last_batch`, as
    `jax.ShapeDtypeStruct`s in the batch's structure, or None."""
    return _last_batch[0] if _last_batch else None


def forget_last_batch() -> None:
    _last_batch.clear()


def _record(structure: Any, arrays: list) -> None:
    """Keep the shapes of the batch laid out last (the arrays already made
    for it: nothing is converted again)."""
    shapes = [
        None if array is None else jax.ShapeDtypeStruct(array.shape, array.dtype)
        for array in arrays
    ]
    _last_batch[:] = [jax.tree_util.tree_unflatten(structure, shapes)]


class _BatchMaker:
    """Pads a global batch and lays it out: each process keeps the rows of its
    own devices. Holds no reference to the iterator that uses it (it may run
    on the prefetch thread)."""

    def __init__(self, distribution: Any, replicate_uneven: bool):
        self._distribution = distribution
        self._replicate_uneven = replicate_uneven
        self._placement: dict[tuple[int, ...], tuple[Any, slice | None]] = {}
        self._one_process = jax.process_count() == 1

    def __call__(self, batch: Any) -> tuple[Any, tuple[int, slice]]:
        """`batch` padded (unless `replicate_uneven`) and laid out, with its
        global size and the rows of it that are real."""
        size = leading_dim(batch)
        if not self._replicate_uneven:
            batch = pad_batch(batch, self._distribution.num_model_replicas)
        kept = (leading_dim(batch), slice(0, size))
        leaves, structure = jax.tree_util.tree_flatten(
            batch, is_leaf=lambda leaf: leaf is None
        )
        arrays = [None if leaf is None else np.asarray(leaf) for leaf in leaves]
        _record(structure, arrays)
        present = [index for index, leaf in enumerate(arrays) if leaf is not None]
        placements = [self._placement_of(arrays[index].shape) for index in present]
        if self._one_process:
            # One call for the whole batch: JAX splits each array between
            # the devices itself (a third less host time a step than one
            # `make_array_from_process_local_data` per array).
            placed = jax.device_put(
                [arrays[index] for index in present],
                [sharding for sharding, _ in placements],
            )
        else:
            # Each process gives the rows of its own devices.
            placed = [
                jax.make_array_from_process_local_data(
                    sharding,
                    arrays[index] if rows is None else arrays[index][rows],
                    arrays[index].shape,
                )
                for index, (sharding, rows) in zip(present, placements, strict=True)
            ]
        for index, array in zip(present, placed, strict=True):
            arrays[index] = array
        return jax.tree_util.tree_unflatten(structure, arrays), kept

    def _placement_of(self, shape: tuple[int, ...]) -> tuple[Any, slice | None]:
        """The sharding of a batch array of `shape`, and the rows of it this
        process gives (None: all of it)."""
        if shape not in self._placement:
            layout = self._distribution.get_data_layout(shape).backend_layout
            if shape[0] % self._distribution.num_model_replicas:
                # Uneven and not padded (`replicate_uneven`): every process
                # holds the whole batch, so each device can get all of it.
                whole = jax.sharding.NamedSharding(
                    layout.mesh, jax.sharding.PartitionSpec()
                )
                self._placement[shape] = (whole, None)
            else:
                self._placement[shape] = (layout, _process_rows(layout, shape))
        return self._placement[shape]


class DistributedBatches:
    """Iterator over one epoch's batches, laid out on the devices.

    Every process reads the same global batches (the input as `fit` received
    it) and keeps the rows that belong to its devices, so each sample is used
    once per epoch across processes. A batch that does not divide the batch
    shards is padded and masked. It counts the padding rows it handed out so
    that `predict` can drop the matching output rows.

    Args:
        batches: the global batches from Keras' data adapter.
        distribution: the active distribution.
        share_random_streams: called before the epoch's first batch, in a
            multi-process job: every process takes process 0's global random
            generators, so Keras' shuffling draws the same order everywhere
            (`keras_dist.random_streams`). None in one process: Keras draws
            from the global generators exactly as without keras_dist.
        check_same_input: compare the first batch's fingerprint across
            processes, to fail fast when they read different data.
        replicate_uneven: lay a batch that does not divide the batch shards
            out whole on every device instead of padding it (for the user's
            own steps, which then see exactly the batch plain Keras gives).
        prefetch: how many batches to make ahead on threads of their own
            (`keras_dist.common.prefetch`), from the second batch on (the
            first, with the multi-process checks above, is made here, and the
            threads start when the second is asked for); 0 makes each batch
            when the step asks for it.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        distribution: Any,
        *,
        share_random_streams: Callable[[], None] | None = None,
        check_same_input: bool = False,
        replicate_uneven: bool = False,
        prefetch: int = 0,
    ):
        self._batches = batches
        self._prefetch = prefetch
        self._prefetcher: Prefetcher | None = None
        self._started = False
        self._share_random_streams = share_random_streams
        self._check_same_input = check_same_input
        self._maker = _BatchMaker(distribution, replicate_uneven)
        # For each batch handed out since `take_kept_rows`: its global size and
        # the rows of it that `predict` returns here.
        self.kept_rows: list[tuple[int, slice]] = []

    def __iter__(self) -> DistributedBatches:
        return self

    def __next__(self) -> Any:
        if self._prefetch and self._started and self._prefetcher is None:
            # From the second batch on, batches are made on the prefetch
            # threads: started now, once the first step is on its way, so that
            # starting them is not time the devices wait between two epochs.
            # No collective runs there (the ones below ran on this thread).
            self._prefetcher = Prefetcher(self._batches, self._maker, self._prefetch)
        if self._prefetcher is not None:
            placed, kept = next(self._prefetcher)
        else:
            if not self._started:
                if self._share_random_streams is not None:
                    self._share_random_streams()
                self._batches = iter(self._batches)
                self._started = True
            batch = next(self._batches)
            if self._check_same_input:
                self._check_same_input = False
                _verify_same_input_everywhere(batch)
            placed, kept = self._maker(batch)
        # Recorded as the batch is handed out (not as it is made ahead), for
        # `take_kept_rows` after the step that used it.
        self.kept_rows.append(kept)
        return placed

    def close(self) -> None:
        """Stop making batches ahead (idempotent)."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __del__(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()

    def take_kept_rows(self) -> list[tuple[int, slice]]:
        kept, self.kept_rows = self.kept_rows, []
        return kept


def _verify_same_input_everywhere(batch: Any) -> None:
    fingerprints = multihost_utils.process_allgather(np.int64(fingerprint(batch)))
    check_same_input([int(value) for value in np.asarray(fingerprints).reshape(-1)])


class ProcessLocalBatches:
    """Iterator over one epoch when each process reads its own data.

    For `auto_shard_dataset=False`: the batch a process reads is its share of
    the global batch. The processes agree on every step's sizes, pad their
    shares to the same size with masked rows, and keep stepping with fully
    masked batches until every process has run out, so they all run the same
    number of steps and none waits for the others forever.
    """

    def __init__(self, batches: Iterator[Any], distribution: Any):
        self._batches = iter(batches)
        self._distribution = distribution
        self._exhausted = False
        self._template: Any = None
        self._local_shards = self._shards_per_process()
        self.kept_rows: list[tuple[int, slice]] = []

    def _shards_per_process(self) -> int:
        shards, processes = self._distribution.num_model_replicas, jax.process_count()
        if shards % processes:
            sequence_axis = getattr(self._distribution, "sequence_axis", None)
            raise ValueError(
                "With auto_shard_dataset=False every process feeds an equal share "
                "of each batch, so the batch axis of the mesh must divide into "
                "the processes"
                + (
                    f" (with sequence_axis={sequence_axis!r}: put the sequence "
                    "axis within a host, e.g. as the mesh's last axis, no larger "
                    "than a process' devices; or leave auto_shard_dataset=True, "
                    "where every process reads whole rows)"
                    if sequence_axis
                    else ""
                )
                + f". Received: {shards} batch shards for {processes} processes"
            )
        return shards // processes

    def __iter__(self) -> ProcessLocalBatches:
        return self

    def __next__(self) -> Any:
        local = None
        if not self._exhausted:
            try:
                local = next(self._batches)
            except StopIteration:
                self._exhausted = True
        if local is not None and self._template is None:
            self._template = local
        size = 0 if local is None else leading_dim(local)
        sizes = np.asarray(
            multihost_utils.process_allgather(np.array([size, local is None]))
        ).reshape(-1, 2)
        if sizes[:, 1].all():
            raise StopIteration
        if self._template is None:
            raise ValueError(
                f"Process {jax.process_index()} has no data at all while others "
                "do; with auto_shard_dataset=False every process needs its part."
            )
        share = padded_size(int(sizes[:, 0].max()), self._local_shards)
        if local is None:
            local = keras.tree.map_structure(
                lambda leaf: None if leaf is None else np.asarray(leaf)[:0],
                self._template,
            )
        local = keras.tree.map_structure(
            lambda leaf: None if leaf is None else pad_rows(leaf, share - size), local
        )
        if (sizes[:, 0] != share).any():
            mask = np.zeros((share,), "float32")
            mask[:size] = 1.0
            local = MaskedBatch(local, mask)
        global_rows = share * jax.process_count()
        placed = keras.tree.map_structure(
            lambda leaf: None if leaf is None else self._place(leaf, global_rows),
            local,
        )
        rows = _process_rows(self._sharding((global_rows,)), (global_rows,))
        self.kept_rows.append((global_rows, slice(rows.start, rows.start + size)))
        return placed

    def _sharding(self, shape: tuple[int, ...]) -> Any:
        return self._distribution.get_data_layout(shape).backend_layout

    def _place(self, leaf: np.ndarray, global_rows: int) -> Any:
        global_shape = (global_rows, *leaf.shape[1:])
        return jax.make_array_from_process_local_data(
            self._sharding(global_shape), leaf, global_shape
        )

    def take_kept_rows(self) -> list[tuple[int, slice]]:
        kept, self.kept_rows = self.kept_rows, []
        return kept


def trim_outputs(outputs: Any, iterator: Any) -> Any:
    """Predictions for the real rows of the batches `iterator` handed out.

    Padding rows are dropped. In a multi-process job the outputs are gathered
    first, so every process gets the whole prediction in input order (or, when
    each process reads its own data, its own rows).
    """
    kept = []
    # With steps_per_execution > 1 on Keras 3.16 the batches come in lists.
    iterator = single_batches(iterator)
    if isinstance(iterator, (DistributedBatches, ProcessLocalBatches)):
        kept = iterator.take_kept_rows()
    index = None
    if kept and any(rows != slice(0, total) for total, rows in kept):
        offsets = np.cumsum([0] + [total for total, _ in kept[:-1]])
        index = np.concatenate(
            [
                offset + np.arange(rows.start, rows.stop)
                for offset, (_, rows) in zip(offsets, kept, strict=True)
            ]
        )

    def finish(output: Any) -> Any:
        if jax.process_count() > 1 and not output.is_fully_addressable:
            output = multihost_utils.process_allgather(output, tiled=True)
        # On the host: Keras concatenates the predictions there anyway, and
        # indexing the device array would compile a gather (and its index
        # arithmetic) for each padded batch's shape.
        return output if index is None else np.asarray(output)[index]

    return keras.tree.map_structure(finish, outputs)
