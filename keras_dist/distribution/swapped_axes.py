"""The swapped-axes rule: a model axis on the model width and the data axis
on another dimension (keras-hub#2827).

In a Megatron-style layout the model axis splits what the width is made of
(heads, the feed-forward's inner units, the vocabulary) and, in a 2-D
sharding such as KerasHub's, the data axis splits the width itself. KerasHub's
Llama, Qwen and Qwen-MoE maps copy Gemma's `(model, data, None)` for the
query/key/value kernels, but their kernels are `(hidden, heads, head_dim)`
where Gemma's are `(heads, hidden, head_dim)`: the model axis lands on the
width. The planner reports it; `keras_dist.layouts.for_keras_hub` swaps the
two axes back.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any


def model_width(
    model: Any, shapes: Iterable[tuple[str, tuple[int, ...]]]
) -> int | None:
    """The model width H: a KerasHub backbone's `hidden_dim` (of the model or
    of its `backbone`), else the most common size among the last dimension of
    embedding tables (variables named `embeddings`) and the first dimension of
    2-D `kernel`s of `shapes` (`(path, shape)` pairs; the larger size on a
    tie); None when there is neither."""
    for owner in (model, getattr(model, "backbone", None)):
        hidden = getattr(owner, "hidden_dim", None)
        if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0:
            return hidden
    sizes: collections.Counter[int] = collections.Counter()
    for path, shape in shapes:
        name = path.rsplit("/", 1)[-1]
        if name == "embeddings" and len(shape) >= 2:
            sizes[shape[-1]] += 1
        elif name == "kernel" and len(shape) == 2:
            sizes[shape[0]] += 1
    if not sizes:
        return None
    return max(sizes, key=lambda size: (sizes[size], size))


def swapped_dimensions(
    shape: Sequence[int],
    axes: Sequence[str | None],
    width: int | None,
    data_axis: str,
) -> tuple[int, int] | None:
    """`(i, j)` when `axes` puts a model axis (any axis but `data_axis`) on
    dimension `i`, of size `width`, and `data_axis` on dimension `j`, of
    another size: the two look swapped. None otherwise."""
    if width is None:
        return None
    axes = tuple(axes)[: len(shape)]  # more axes than dimensions: refused elsewhere
    on_width = [
        i
        for i, axis in enumerate(axes)
        if axis is not None and axis != data_axis and shape[i] == width
    ]
    data_elsewhere = [
        j for j, axis in enumerate(axes) if axis == data_axis and shape[j] != width
    ]
    if on_width and data_elsewhere:
        return on_width[0], data_elsewhere[0]
    return None


def swap(axes: Sequence[str | None], first: int, second: int) -> tuple:
    """`axes` with the entries at `first` and `second` exchanged."""
    swapped = list(axes)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    return tuple(swapped)
