"""Keras' rematerialization: the mode a layer recomputes its call with in the
backward pass (`keras.RematScope`), read and set on layers built before."""

from __future__ import annotations

from collections.abc import Callable
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


def wrap_recomputed_calls(
    layers: list[Any], wrap: Callable[[Any, Callable], Callable]
) -> Callable[[], None]:
    """While in effect, the call each of `layers` rematerializes (what Keras'
    `Layer.rematerialized_call` gets: the layer's `call`, run by activation
    checkpointing on the forward pass and again in backward) is
    `wrap(layer, call)`; return the undo."""

    def rematerialized(layer: Any) -> Callable:
        def rematerialized_call(layer_call: Callable, *args: Any, **kwargs: Any) -> Any:
            return type(layer).rematerialized_call(
                layer, wrap(layer, layer_call), *args, **kwargs
            )

        return rematerialized_call

    for layer in layers:
        # On the instance, past Keras' attribute tracking.
        layer.__dict__["rematerialized_call"] = rematerialized(layer)

    def undo() -> None:
        for layer in layers:
            layer.__dict__.pop("rematerialized_call", None)

    return undo


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
    # A layer with a mode hands its call to `rematerialized_call` (looked up on
    # the instance), which `wrap_recomputed_calls` wraps.
    wrapped = []

    def wrap(layer: Any, call: Callable) -> Callable:
        wrapped.append(layer)
        return call

    undo = wrap_recomputed_calls([plain], wrap)
    try:
        set_mode(plain, mode)
        plain(keras.ops.ones((1, 3)))
    finally:
        set_mode(plain, None)
        undo()
    if wrapped != [plain] or "rematerialized_call" in plain.__dict__:
        missing.append("Operation.__call__ -> self.rematerialized_call(self.call)")
    return missing
