"""Keras' distribution base class, which Keras does not export, and the
backend `distribution_lib` Keras' distribution code calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

# Keras does not export the policies' base class; it is the common base of
# its DataParallel and ModelParallel.
KerasDistribution = keras.distribution.DataParallel.__mro__[1]


class _OutputLayouts:
    """Keras' backend `distribution_lib` with `distribute_tensor` replaced.

    Keras' `Layer.__call__` relays a layer's output out through
    `distribution_lib.distribute_tensor` when the layout map names
    `"<layer path>/output"`; Keras 3.16 also calls the module's other
    functions (`_to_backend_layout`, `num_processes`, the torch dispatch
    mode's switches...), which go to the real module. Keras 3.15 on torch has
    no such module (None): then only `distribute_tensor` exists.
    """

    def __init__(self, module: Any, distribute: Callable[[Any, Any], Any]):
        self._module = module
        self.distribute_tensor = distribute

    def __getattr__(self, name: str) -> Any:
        if self._module is None:
            raise AttributeError(
                f"Keras {keras.__version__} has no {keras.backend.backend()} "
                f"distribution_lib; keras_dist routes only distribute_tensor. "
                f"Received: a read of {name!r}"
            )
        return getattr(self._module, name)


def route_output_layouts(distribute: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """Send Keras' layer-output relayouts to `distribute(tensor, layout)`
    until the returned undo; every other use of the backend's
    `distribution_lib` by Keras' distribution code reaches the real one."""
    from keras.src.distribution import distribution_lib  # noqa: PLC0415

    saved = distribution_lib.distribution_lib
    distribution_lib.distribution_lib = _OutputLayouts(saved, distribute)

    def undo() -> None:
        distribution_lib.distribution_lib = saved

    return undo


def check() -> list[str]:
    """What keras_dist's policies need from Keras' base class, and the backend
    module `route_output_layouts` stands in for."""
    from keras.src.distribution import distribution_lib  # noqa: PLC0415

    missing = []
    if KerasDistribution.__name__ != "Distribution" or not issubclass(
        keras.distribution.ModelParallel, KerasDistribution
    ):
        missing.append("keras.distribution.DataParallel.__mro__[1] is Distribution")
    for name in (
        "scope",
        "get_data_layout",
        "get_variable_layout",
        "get_tensor_layout",
        "auto_shard_dataset",
    ):
        if not hasattr(KerasDistribution, name):
            missing.append(f"Distribution.{name}")
    if not hasattr(distribution_lib, "distribution_lib"):
        missing.append("keras.src.distribution.distribution_lib.distribution_lib")
    return missing
