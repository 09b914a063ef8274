"""The mesh `keras_dist.plan(..., mesh={...})` lays a distribution out on:
this machine's devices when it has enough, else placeholder names (the
planner never touches a device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from keras_dist.distribution.mesh import DeviceMesh
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.runtime import api as runtime


def check_mesh(mesh: Any) -> None:
    """Raise unless `mesh` is `{axis name: positive size}`, not empty."""
    sizes = list(mesh.values()) if isinstance(mesh, Mapping) else []
    if (
        not sizes
        or not all(isinstance(axis, str) and axis for axis in mesh)
        or not all(
            isinstance(size, (int, np.integer)) and not isinstance(size, bool)
            for size in sizes
        )
        or min(sizes) < 1
    ):
        raise ValueError(
            "`mesh` must be a dict of axis names to sizes (positive ints), data "
            f"axis first, e.g. {{'batch': 2, 'model': 4}}. Received: mesh={mesh!r}"
        )


def distribution_on_mesh(
    make: Callable[[Any], Any], sizes: Mapping[str, int], devices: Any = None
) -> tuple[Any, bool]:
    """`make(mesh)` on a mesh of `sizes`, on `devices` (an array of the
    mesh's shape: a topology's) or else this machine's devices when it has
    enough, else on placeholder names; and whether they are placeholders."""
    shape = tuple(int(size) for size in sizes.values())
    count = math.prod(shape)
    placeholders = False
    if devices is None:
        devices = runtime.list_devices()
        placeholders = len(devices) < count
        if placeholders:
            kind = devices[0].partition(":")[0] if devices else "cpu"
            devices = [f"{kind}:{index}" for index in range(count)]
        devices = devices[:count]
    mesh = DeviceMesh(shape, list(sizes), devices)
    distribution = make(mesh)
    if not isinstance(distribution, KerasDistribution):
        raise TypeError(
            "The `distribution` function must return a DataParallel, "
            f"ModelParallel or FSDP. Received: {distribution!r} from "
            f"distribution={make!r}"
        )
    made = distribution.device_mesh
    if tuple(made.shape) != shape or list(made.axis_names) != list(sizes):
        raise ValueError(
            "The `distribution` function must lay the distribution out on the "
            f"mesh it is given, {dict(sizes)}; it returned one on "
            f"{dict(zip(made.axis_names, made.shape, strict=True))}. Received: "
            f"distribution={make!r}"
        )
    return distribution, placeholders
