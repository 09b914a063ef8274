"""Keras' own shuffle order, the same on every process.

Keras shuffles from the global random generators: its array adapter with
NumPy's (`np.random.permutation` when an epoch's first batch is read, or one per
batch for `shuffle="batch"`), a `PyDataset` with Python's `random`, and on
PyTorch the array adapter's `DataLoader` with torch's. keras_dist reads Keras'
own batches, so one process draws exactly what plain Keras draws, in the same
place. In a multi-process job every process first takes process 0's generator
states (`take_process_zero_streams`, just before an epoch's first batch): all
draw process 0's order and, having drawn the same, stay in step afterwards.
With `keras.utils.set_random_seed(seed)` on every process the states are equal
already, and the order is the one plain Keras gets on one device.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# NumPy: 624 key words, position, has_gauss, cached gaussian (2 words);
# Python: 625 state words, has gauss_next, gauss_next (2 words).
_NUMPY_WORDS = 624 + 1 + 1 + 2
_PYTHON_WORDS = 625 + 1 + 2
STATE_WORDS = _NUMPY_WORDS + _PYTHON_WORDS


def _float_words(value: float) -> list[int]:
    return [int(word) for word in np.array([value], "float64").view("uint32")]


def _words_float(words: np.ndarray) -> float:
    return float(np.asarray(words, "uint32").view("float64")[0])


def global_random_state() -> np.ndarray:
    """NumPy's and Python's global generator states as one uint32 vector."""
    # NumPy's global (legacy) generator is always an MT19937; Python's state
    # is (version 3, 625 words, gauss_next).
    _, keys, position, has_gauss, cached = np.random.get_state()
    _, words, gauss_next = random.getstate()
    python_gauss = [0, 0, 0] if gauss_next is None else [1, *_float_words(gauss_next)]
    vector = [
        *keys.tolist(),
        int(position),
        int(has_gauss),
        *_float_words(cached),
        *words,
        *python_gauss,
    ]
    return np.asarray(vector, "uint32")


def set_global_random_state(state: np.ndarray) -> None:
    """Give NumPy's and Python's global generators the states of `state`."""
    state = np.asarray(state).astype("uint32")
    keys, position, has_gauss = state[:624], int(state[624]), int(state[625])
    cached = _words_float(state[626:628])
    np.random.set_state(("MT19937", keys, position, has_gauss, cached))
    python = state[_NUMPY_WORDS:]
    words = tuple(int(word) for word in python[:625])
    gauss_next = _words_float(python[626:628]) if python[625] else None
    random.setstate((3, words, gauss_next))


@dataclass(frozen=True)
class BackendStream:
    """A backend's own global generator (torch's), read and set as words."""

    get: Callable[[], np.ndarray]
    set: Callable[[np.ndarray], None]


def take_process_zero_streams(
    broadcast: Callable[[np.ndarray], np.ndarray],
    backend_stream: BackendStream | None = None,
) -> None:
    """Every process takes process 0's global generator states.

    Args:
        broadcast: sends process 0's uint32 vector to every process (a
            collective: every process calls this at the same point).
        backend_stream: the backend's own global generator, shared too.
    """
    parts = [global_random_state()]
    if backend_stream is not None:
        parts.append(np.asarray(backend_stream.get(), "uint32"))
    state = np.asarray(broadcast(np.concatenate(parts))).astype("uint32")
    set_global_random_state(state[:STATE_WORDS])
    if backend_stream is not None:
        backend_stream.set(state[STATE_WORDS:])


def pack_random_states(streams: list[BackendStream | None]) -> list[int]:
    """NumPy's and Python's global generators, then each of `streams` (None:
    absent), as one list of words for a checkpoint's manifest: the pieces in
    that order, each led by its length."""
    pieces = [global_random_state()]
    for stream in streams:
        pieces.append(
            np.zeros(0, "uint32")
            if stream is None
            else np.asarray(stream.get(), "uint32")
        )
    words: list[int] = []
    for piece in pieces:
        words += [len(piece), *(int(word) for word in piece)]
    return words


def unpack_random_states(words: list[int], streams: list[BackendStream | None]) -> None:
    """Set the global generators and each of `streams` from what
    `pack_random_states` gave (a stream that is None, or absent from `words`,
    is left as it is)."""
    pieces, index = [], 0
    while index < len(words):
        length = int(words[index])
        pieces.append(np.asarray(words[index + 1 : index + 1 + length], "uint32"))
        index += 1 + length
    if not pieces:
        return
    set_global_random_state(pieces[0])
    for stream, piece in zip(streams, pieces[1:], strict=False):
        if stream is not None and len(piece):
            stream.set(piece)
