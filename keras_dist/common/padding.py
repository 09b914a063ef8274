"""Padding a batch to a size the devices can split, with a mask for the pad.

Backend-neutral: works on NumPy arrays. The adapters lay the padded arrays out
on devices and the step functions use the mask so that padded rows never count.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import keras
import numpy as np


class MaskedBatch(NamedTuple):
    """A batch padded with rows that must not count.

    Attributes:
        data: the padded `(x,)`, `(x, y)` or `(x, y, sample_weight)` tuple.
        mask: float32 vector, 1 for real rows and 0 for padding.
    """

    data: Any
    mask: Any


def leading_dim(data: Any) -> int:
    """The batch size of a nested structure of arrays."""
    for leaf in keras.tree.flatten(data):
        if leaf is not None and getattr(leaf, "shape", None):
            return int(leaf.shape[0])
    raise ValueError(
        "Could not find the batch dimension: the batch holds no arrays. "
        f"Received: a batch of type {type(data).__name__}"
    )


def padded_size(batch_size: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that holds `batch_size` rows."""
    return -(-batch_size // multiple) * multiple


def pad_rows(array: Any, rows: int) -> np.ndarray:
    """`array` with `rows` zero rows appended along axis 0."""
    array = np.asarray(array)
    padding = [(0, rows)] + [(0, 0)] * (array.ndim - 1)
    return np.pad(array, padding)


def pad_batch(data: Any, multiple: int) -> Any:
    """Pad `data` so its batch divides `multiple`; return it as is if it does.

    Returns:
        `data` unchanged when its batch size divides `multiple`, else a
        `MaskedBatch` whose arrays have zero rows appended and whose mask marks
        the real rows.
    """
    if multiple < 1:
        raise ValueError(f"`multiple` must be at least 1. Received: {multiple}")
    size = leading_dim(data)
    target = padded_size(size, multiple)
    if target == size:
        return data
    extra = target - size
    padded = keras.tree.map_structure(
        lambda leaf: None if leaf is None else pad_rows(leaf, extra), data
    )
    mask = np.zeros((target,), dtype="float32")
    mask[:size] = 1.0
    return MaskedBatch(padded, mask)


def masked_row_weights(mask: Any, sample_weight: Any, targets: Any = None) -> Any:
    """Per-row weights: the user's `sample_weight` with padded rows zeroed.

    Without a `sample_weight`, the mask itself; shaped `(rows, 1)` when every
    array of `targets` has two dimensions or more, so that it broadcasts
    against a loss computed per position (`[batch, sequence]` token losses)
    as well as against one per row (Keras drops a trailing 1 there).

    Works on backend tensors (inside a traced step too) through `keras.ops`.
    """
    if sample_weight is None:
        leaves = [leaf for leaf in keras.tree.flatten(targets) if leaf is not None]
        if leaves and all(len(getattr(leaf, "shape", ())) >= 2 for leaf in leaves):
            return keras.ops.reshape(mask, (-1, 1))
        return mask
    mask = keras.ops.cast(mask, sample_weight.dtype)
    mask = keras.ops.reshape(mask, (-1,) + (1,) * (len(sample_weight.shape) - 1))
    return sample_weight * mask


def fingerprint(batch: Any) -> int:
    """A 56-bit hash of a batch's arrays, to compare what processes read."""
    digest = hashlib.blake2b(digest_size=7)
    for leaf in keras.tree.flatten(batch):
        if leaf is not None:
            digest.update(np.ascontiguousarray(leaf).tobytes())
    return int.from_bytes(digest.digest(), "little")


def check_same_input(fingerprints: list[int]) -> None:
    """Raise if processes (indexed like `fingerprints`) read different batches."""
    differing = [
        rank for rank, value in enumerate(fingerprints) if value != fingerprints[0]
    ]
    if differing:
        raise ValueError(
            f"Processes {differing} read different input than process 0, so "
            "splitting each batch between processes would drop and repeat "
            "samples. Give every process the same data in the same order (seed "
            "shuffling: keras.utils.set_random_seed(seed) before building the "
            "dataset), or pass auto_shard_dataset=False and feed each process "
            "its own part."
        )
