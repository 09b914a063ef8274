"""The global distribution, shared with `keras.distribution`."""

from __future__ import annotations

from typing import Any

import keras

from keras_dist._keras_compat import KerasDistribution
from keras_dist.backends import get_adapter


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
    the layout instead of moving data).

    Args:
        tensor: a backend tensor or NumPy array.
        layout: a `TensorLayout` with a device mesh.
    """
    if not isinstance(layout, keras.distribution.TensorLayout):
        raise TypeError(
            "`layout` must be a TensorLayout. Received: "
            f"layout={layout!r} of type {type(layout).__name__}"
        )
    if layout.device_mesh is None:
        raise ValueError(
            "`layout` has no device mesh; build it with `device_mesh=`. "
            f"Received: layout={layout}"
        )
    return get_adapter().distribute_tensor(tensor, layout)
