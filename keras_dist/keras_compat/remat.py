"""Keras' rematerialization: the mode a layer recomputes its call with in the
backward pass (`keras.RematScope`), read and set on layers built before."""

from __future__ import annotations

from typing import Any

import keras


def mode_of_scope(scope: Any) -> Any:
    """The mode a layer built inside `scope` (a `keras.RematScope`) gets."""
    from keras.src.backend.common.remat import get_current_remat_mode  # noqa: PLC0415

    with scope:
        return get_current_remat_mode()


def mode_of(layer: Any) -> Any:
    """`layer`'s own mode (None: its call is not rematerialized)."""
    return layer._remat_mode


def set_mode(layer: Any, mode: Any) -> None:
    """From now on `layer`'s call recomputes in backward as `mode` says (Keras
    reads it at each call, as if the layer had been built under the scope)."""
    layer._remat_mode = mode


def check() -> list[str]:
    """What `mode_of_scope`, `mode_of` and `set_mode` need."""
    missing = []
    try:
        mode = mode_of_scope(keras.RematScope(mode="full"))
    except ImportError:
        return ["keras.src.backend.common.remat.get_current_remat_mode"]
    if getattr(mode, "mode", None) != "full":
        missing.append("get_current_remat_mode() -> RematMode(mode, ...)")
    with keras.RematScope(mode="full"):
        built_inside = keras.layers.Dense(2)
    plain = keras.layers.Dense(2)
    if getattr(built_inside, "_remat_mode", None) != mode or (
        getattr(plain, "_remat_mode", "absent") is not None
    ):
        missing.append("Operation._remat_mode")
    if not hasattr(plain, "rematerialized_call"):
        missing.append("Layer.rematerialized_call")
    return missing
