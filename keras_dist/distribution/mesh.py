"""Device meshes and tensor layouts.

`DeviceMesh` and `TensorLayout` subclass their `keras.distribution` namesakes, so
Keras (and KerasHub's `isinstance` checks) accept them, but they validate their
arguments up front and resolve devices and backend objects through the backend
adapter, which works on every backend.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.runtime import api as runtime

_DEVICE_NAME = re.compile(r"^[a-z]+:\d+$")


def _validate_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not isinstance(shape, (list, tuple)) or not shape:
        raise TypeError(
            "`shape` must be a non-empty list or tuple of positive ints, such as "
            f"(2, 4). Received: shape={shape!r}"
        )
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"`shape` must hold ints. Received: shape={shape!r}")
        if size < 1:
            raise ValueError(
                f"Every dimension of `shape` must be at least 1. Received: "
                f"shape={shape!r}"
            )
    return tuple(int(size) for size in shape)


def _validate_axis_names(axis_names: Any, shape: tuple[int, ...]) -> list[str]:
    if isinstance(axis_names, (str, list, tuple)) and not axis_names:
        # Keras raises ValueError for empty axis names too.
        raise ValueError(
            "`axis_names` must not be empty: give one name per mesh dimension, "
            f"such as ['batch', 'model']. Received: axis_names={axis_names!r}"
        )
    if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
        raise TypeError(
            "`axis_names` must be a list or tuple of strings, one per mesh "
            f"dimension, such as ['batch', 'model']. Received: "
            f"axis_names={axis_names!r}"
        )
    names = list(axis_names)
    if len(names) != len(shape):
        raise ValueError(
            "`axis_names` must name every dimension of `shape`. Received: "
            f"shape={shape}, axis_names={names}"
        )
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                "Every axis name must be a non-empty string. Received: "
                f"axis_names={names!r}"
            )
        if not name:
            raise ValueError(
                "Every axis name must be a non-empty string. Received: "
                f"axis_names={names!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"Axis names must be unique. Received: axis_names={names}")
    return names


def _validate_devices(devices: Any, shape: tuple[int, ...]) -> np.ndarray:
    if devices is None:
        devices = runtime.list_devices()
        if len(devices) != math.prod(shape):
            raise ValueError(
                f"A mesh of shape {shape} needs {math.prod(shape)} devices, but "
                f"{len(devices)} are available: {devices}. Pass `devices=` or a "
                "shape whose product is the device count (to plan a mesh this "
                "machine lacks, give `keras_dist.plan` its shape: mesh={...})."
            )
    array = np.asarray(devices, dtype=object)
    flat = list(array.reshape(-1))
    if not flat:
        raise ValueError(f"`devices` must not be empty. Received: devices={devices!r}")
    for device in flat:
        if isinstance(device, str) and not _DEVICE_NAME.match(device):
            raise ValueError(
                "Device names look like 'cpu:0' or 'gpu:3' (see "
                f"`keras_dist.list_devices()`). Received: device={device!r}"
            )
    names = [str(device) for device in flat]
    if len(set(names)) != len(names):
        raise ValueError(
            f"Every device may appear in a mesh once. Received: devices={names}"
        )
    if len(flat) != math.prod(shape):
        raise ValueError(
            f"A mesh of shape {shape} needs {math.prod(shape)} devices. "
            f"Received: {len(flat)} devices {names}"
        )
    return array.reshape(shape)


class DeviceMesh(keras.distribution.DeviceMesh):
    """A grid of devices with a name for each axis.

    Args:
        shape: ints, the number of devices along each axis, e.g. `(2, 4)`.
        axis_names: one name per axis, e.g. `["batch", "model"]`.
        devices: device names such as `"cpu:0"` (or backend device objects),
            flat or already shaped. Defaults to `keras_dist.list_devices()`.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    >>> mesh.shape
    (1, 1)
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        devices: Sequence[Any] | np.ndarray | None = None,
    ):
        # Keras' own constructor lists devices through a backend module that
        # only exists for JAX, so the fields are set here instead.
        self._shape = _validate_shape(shape)
        self._axis_names = _validate_axis_names(axis_names, self._shape)
        self._devices = _validate_devices(devices, self._shape)
        self._backend_mesh = None

    @property
    def backend_mesh(self) -> Any:
        if self._backend_mesh is None:
            self._backend_mesh = get_adapter().to_backend_mesh(self)
        return self._backend_mesh

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, keras.distribution.DeviceMesh):
            return NotImplemented
        return describe_mesh(self) == describe_mesh(other)

    def __hash__(self) -> int:
        return hash((self.shape, tuple(self.axis_names)))


def describe_mesh(device_mesh: Any) -> str:
    """Shape, axis names and devices of any mesh (keras_dist's or Keras')."""
    devices = [str(d) for d in np.asarray(device_mesh.devices).reshape(-1)]
    return (
        f"DeviceMesh(shape={tuple(device_mesh.shape)}, "
        f"axis_names={list(device_mesh.axis_names)}, devices={devices})"
    )


def validate_axes_in_mesh(axes: Sequence[str | None], device_mesh: Any) -> None:
    """Raise if a layout names an axis that `device_mesh` does not have."""
    for axis in axes:
        if axis is not None and axis not in device_mesh.axis_names:
            raise ValueError(
                f"Layout axis {axis!r} is not an axis of the device mesh. Use one "
                f"of {list(device_mesh.axis_names)} or None. Received: "
                f"axes={tuple(axes)}"
            )


class TensorLayout(keras.distribution.TensorLayout):
    """How one tensor is laid out on a `DeviceMesh`.

    Args:
        axes: for each tensor dimension, the mesh axis it is split along, or
            `None` to replicate it.
        device_mesh: the mesh; may be set later (a `LayoutMap` sets its own).

    Example:

    >>> layout = keras_dist.TensorLayout((None, "model"))
    >>> layout.axes
    (None, 'model')
    """

    def __init__(
        self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None
    ):
        if isinstance(axes, str) or not isinstance(axes, Sequence):
            raise TypeError(
                "`axes` must be a list or tuple with one mesh axis name or None "
                f"per tensor dimension, such as (None, 'model'). Received: "
                f"axes={axes!r}"
            )
        axes = tuple(axes)
        for axis in axes:
            if axis is not None and not isinstance(axis, str):
                raise TypeError(
                    "Every entry of `axes` must be a mesh axis name or None. "
                    f"Received: axes={axes!r}"
                )
        named = [axis for axis in axes if axis is not None]
        if len(set(named)) != len(named):
            raise ValueError(
                "A mesh axis may shard at most one tensor dimension. Received: "
                f"axes={axes!r}"
            )
        self._axes = axes
        self._device_mesh = None
        self._backend_layout = None
        if device_mesh is not None:
            self.device_mesh = device_mesh

    @property
    def axes(self) -> tuple[str | None, ...]:
        return self._axes

    @property
    def device_mesh(self) -> Any:
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, device_mesh: Any) -> None:
        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise TypeError(
                "`device_mesh` must be a DeviceMesh. Received: "
                f"device_mesh={device_mesh!r} of type {type(device_mesh).__name__}"
            )
        if self._device_mesh is not None and self._device_mesh is not device_mesh:
            raise ValueError(
                "This TensorLayout already has a device mesh; build a new "
                f"layout for another mesh. Received: device_mesh={device_mesh}"
            )
        validate_axes_in_mesh(self._axes, device_mesh)
        self._device_mesh = device_mesh
        self._backend_layout = None

    @property
    def backend_layout(self) -> Any:
        if self._device_mesh is None:
            raise ValueError(
                "This TensorLayout has no device mesh yet; pass `device_mesh=` or "
                f"put it in a LayoutMap that has one. Received: axes={self._axes}"
            )
        if self._backend_layout is None:
            self._backend_layout = get_adapter().to_backend_layout(self)
        return self._backend_layout

    def __repr__(self) -> str:
        return f"<TensorLayout axes={self._axes}, device_mesh={self._device_mesh}>"


def check_mesh(device_mesh: Any) -> Any:
    """`device_mesh` if it is a `DeviceMesh` (keras_dist's or Keras'), else
    `TypeError`."""
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "`device_mesh` must be a DeviceMesh (keras_dist's or Keras'). "
            f"Received: device_mesh={device_mesh!r} of type "
            f"{type(device_mesh).__name__}"
        )
    return device_mesh


def one_axis_mesh(device_mesh: Any, devices: Any, axis: str, who: str) -> Any:
    """`device_mesh`, else a 1-D mesh named `axis` over `devices` (every
    device of `list_devices()` when None); `who` names the policy in errors."""
    if device_mesh is not None and devices is not None:
        raise ValueError(
            f"Give {who} either `device_mesh` or `devices`, not both. "
            f"Received: device_mesh={device_mesh}, devices={devices}"
        )
    if device_mesh is not None:
        return check_mesh(device_mesh)
    if devices is None:
        devices = runtime.list_devices()
    if isinstance(devices, str) or not isinstance(devices, (list, tuple, np.ndarray)):
        raise TypeError(
            "`devices` must be a list of device names such as "
            f"['cpu:0', 'cpu:1']. Received: devices={devices!r}"
        )
    devices = list(np.asarray(devices, dtype=object).reshape(-1))
    if not devices:
        raise ValueError(
            "`devices` must name at least one device. Received: devices=[]"
        )
    return DeviceMesh((len(devices),), [axis], devices)
