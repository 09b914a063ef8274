"""`LayoutMap`: from variable and tensor paths to `TensorLayout`s."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from typing import Any

import keras

from keras_dist.distribution.mesh import TensorLayout
from keras_dist.keras_compat.layers import fresh_names, fresh_path


class LayoutMap(keras.distribution.LayoutMap):
    """An ordered map from path patterns to `TensorLayout`s.

    A lookup tries the exact key first, then searches every key as a regular
    expression (`re.search`) in the path. Two or more matching keys are an
    error naming them; no match returns `None`.

    Args:
        device_mesh: the mesh given to every layout stored without one.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    >>> layout_map = keras_dist.LayoutMap(mesh)
    >>> layout_map["dense.*kernel"] = (None, "model")
    >>> layout_map["dense_1/kernel"].axes
    (None, 'model')
    """

    # True where the keys name paths in the model's own numbering of its
    # automatically named layers (`keras_compat.layers.fresh_names`), as the
    # maps of `keras_dist.layouts` do: such a map is looked up with the paths
    # of the model it is `bind`-ed to, renamed so.
    keys_name_fresh_paths = False

    def __init__(self, device_mesh: Any = None):
        self._names: dict[str, str] = {}
        if device_mesh is not None and not isinstance(
            device_mesh, keras.distribution.DeviceMesh
        ):
            raise TypeError(
                "`device_mesh` must be a DeviceMesh or None. Received: "
                f"device_mesh={device_mesh!r} of type {type(device_mesh).__name__}"
            )
        self._layout_map: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._device_mesh = device_mesh

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise TypeError(f"LayoutMap keys are path strings. Received: key={key!r}")
        if key in self._layout_map:  # a key itself, as the planner asks
            return self._layout_map[key]
        return self.layout_at(self.lookup_path(key))

    def layout_at(self, path: str) -> Any:
        """The layout for `path` as the keys name paths (for a map bound to
        a model, `lookup_path` of its path): the exact key, else the one key
        that matches; None if none does."""
        if path in self._layout_map:
            return self._layout_map[path]
        matches = [pattern for pattern in self._layout_map if re.search(pattern, path)]
        if len(matches) > 1:
            raise ValueError(
                f"Path {path!r} matches more than one LayoutMap key: {matches}. "
                "Make the keys specific enough that each path matches one."
            )
        return self._layout_map[matches[0]] if matches else None

    def __setitem__(self, key: str, layout: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(
                f"LayoutMap keys are path strings or regexes. Received: key={key!r}"
            )
        if key in self._layout_map:
            raise ValueError(
                f"LayoutMap already has the key {key!r} (layout "
                f"{self._layout_map[key]}). Each key may be set once; delete it "
                "first to replace it."
            )
        try:
            re.compile(key)
        except re.error as error:
            raise ValueError(
                f"LayoutMap keys are regular expressions; {key!r} is not a valid "
                f"one ({error})."
            ) from None
        if isinstance(layout, (tuple, list)):
            layout = TensorLayout(tuple(layout))
        if not isinstance(layout, keras.distribution.TensorLayout):
            raise TypeError(
                "LayoutMap values must be a TensorLayout or a tuple of mesh axis "
                f"names and None. Received: {key!r} -> {layout!r}"
            )
        if layout.device_mesh is None and self._device_mesh is not None:
            layout.device_mesh = self._device_mesh
        self._layout_map[key] = layout

    def __delitem__(self, key: str) -> None:
        del self._layout_map[key]

    def __len__(self) -> int:
        return len(self._layout_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout_map)

    @property
    def device_mesh(self) -> Any:
        return self._device_mesh

    def bind(self, model: Any) -> None:
        """Look up `model`'s variable paths from now on. Does nothing unless
        `keys_name_fresh_paths`: then a path of `model` is looked up with its
        automatically numbered layer names (`dense_5`, which depend on what
        the process built before) replaced by the model's own numbering
        (`dense`, the model's first Dense), so that the map lays out every
        build of the same architecture alike."""
        if self.keys_name_fresh_paths:
            self._names = fresh_names(model)

    def lookup_path(self, path: str) -> str:
        """The path the keys are matched against for `path`, a path of the
        model the map is bound to (`bind`)."""
        return fresh_path(path, self._names) if self._names else path


def bind_layout_map(distribution: Any, model: Any) -> None:
    """Bind `distribution`'s keras_dist `LayoutMap`, if it has one, to
    `model` (`LayoutMap.bind`); Keras' own maps keep their lookup."""
    layout_map = getattr(distribution, "layout_map", None)
    if isinstance(layout_map, LayoutMap):
        layout_map.bind(model)


# -- LoRA factors laid out with their base kernel ------------------------------
# Keras' `enable_lora(rank)` adds, beside a layer's `kernel`, `lora_kernel_a`
# of shape kernel.shape[:-1] + (rank,) and `lora_kernel_b` of shape
# (rank, kernel.shape[-1]); the layer adds `a @ b` (times a scale) to its
# kernel. Laid out as the kernel is on the dimensions they share (and
# replicated along the small rank), `a @ b` comes out laid out as the kernel:
#
#     kernel   (d0, ..., dn-1, dn)   axes (x0, ..., xn-1, xn)
#     a        (d0, ..., dn-1, r)    axes (x0, ..., xn-1, None)
#     b        (r, dn)               axes (None, xn)
LORA_FACTORS = ("lora_kernel_a", "lora_kernel_b")


def lora_base_path(path: str) -> str | None:
    """The path of the kernel a LoRA factor belongs to, or None."""
    head, _, name = path.rpartition("/")
    return f"{head}/kernel" if head and name in LORA_FACTORS else None


def lora_axes(
    path: str, factor_rank: int, kernel_axes: tuple, kernel_rank: int
) -> tuple:
    """The axes of the LoRA factor at `path` (of `factor_rank` dimensions)
    from its kernel's (`kernel_axes`, spelled out or fewer, of a kernel of
    `kernel_rank` dimensions): see above."""
    axes = tuple(kernel_axes) + (None,) * (kernel_rank - len(kernel_axes))
    if path.endswith("lora_kernel_a"):
        return axes[: factor_rank - 1] + (None,)
    return (None, axes[-1])
