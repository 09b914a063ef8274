"""The global distribution, shared with `keras.distribution`."""

from __future__ import annotations

from typing import Any

import keras

from keras_dist.backends import get_adapter
from keras_dist.keras_compat.distribution import KerasDistribution


def distribution() -> Any:
    """The distribution in effect, or `None`: the same one Keras sees."""
    return keras.distribution.distribution()


def set_distribution(value: Any) -> None:
    """Make `value` the distribution for Keras and keras_dist alike.

    Args:
        value: a `Distribution` (keras_dist's or Keras'), or `None` to clear it.

    Example:

    >>> keras_dist.set_distribution(keras_dist.DataParallel(devices=["cpu:0"]))
    >>> keras_dist.set_distribution(None)
    """
    if value is not None and not isinstance(value, KerasDistribution):
        raise TypeError(
            "`value` must be a Distribution such as keras_dist.DataParallel, or "
            f"None. Received: value={value!r} of type {type(value).__name__}"
        )
    keras.distribution.set_distribution(value)


def distribute_tensor(tensor: Any, layout: Any) -> Any:
    """Lay `tensor` out on devices as `layout` says.

    Works eagerly and inside a traced or jitted function (where it constrains
    the layout instead of moving data). As in Keras, a symbolic `KerasTensor`
    (from `keras.Input`, while a functional model is built) is returned
    unchanged.

    Args:
        tensor: a backend tensor, NumPy array or `KerasTensor`.
        layout: a `TensorLayout` with a device mesh, or the backend's own
            layout object, what `TensorLayout.backend_layout` gives: a
            `jax.sharding.Sharding` such as `NamedSharding` on JAX (as Keras
            accepts), a tuple of DTensor placements for a DTensor on PyTorch.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1,), ["batch"], ["cpu:0"])
    >>> layout = keras_dist.TensorLayout(("batch", None), mesh)
    >>> symbolic = keras.Input((3,))
    >>> keras_dist.distribute_tensor(symbolic, layout) is symbolic
    True
    """
    adapter = get_adapter()
    is_layout = isinstance(layout, keras.distribution.TensorLayout)
    if not is_layout and not adapter.is_backend_layout(layout):
        raise TypeError(
            "`layout` must be a TensorLayout, or the backend's own layout "
            "(what `TensorLayout.backend_layout` gives, e.g. a "
            "jax.sharding.NamedSharding on JAX). Received: "
            f"layout={layout!r} of type {type(layout).__name__}"
        )
    if isinstance(tensor, keras.KerasTensor):
        # Symbolic: it only describes a functional model's graph.
        return tensor
    if is_layout and layout.device_mesh is None:
        raise ValueError(
            "`layout` has no device mesh; build it with `device_mesh=`. "
            f"Received: layout={layout}"
        )
    return adapter.distribute_tensor(tensor, layout)
