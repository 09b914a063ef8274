"""Keras' BatchNormalization: its moments, computed by keras_dist instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat.layers import layers_of


def replace_moments(model: Any, moments: Callable[..., Any]) -> Callable[[], None]:
    """Make every BatchNormalization layer of `model` compute its training
    statistics with `moments(inputs, mask, axes=..., keras_moments=...,
    name=...)` (the signature of `GlobalBatchNorm.moments` past its first
    argument) instead of its own `_moments`; return the undo."""
    layers = [
        layer
        for layer in layers_of(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    for layer in layers:
        # On the instance, past Keras' attribute tracking; the class' method
        # comes back when it is removed.
        layer.__dict__["_moments"] = _layer_moments(layer, moments)

    def undo() -> None:
        for layer in layers:
            layer.__dict__.pop("_moments", None)

    return undo


def _layer_moments(layer: Any, moments: Callable[..., Any]) -> Callable[..., Any]:
    def keras_moments(inputs: Any, mask: Any) -> Any:
        return type(layer)._moments(layer, inputs, mask)

    def layer_moments(inputs: Any, mask: Any) -> Any:
        # The reduction axes are known once the layer is built.
        return moments(
            inputs,
            mask,
            axes=tuple(layer._reduction_axes),
            keras_moments=keras_moments,
            name=layer.name,
        )

    return layer_moments


def check() -> list[str]:
    """What `replace_moments` needs."""
    missing = []
    batch_norm = keras.layers.BatchNormalization()
    if not callable(getattr(batch_norm, "_moments", None)):
        missing.append("BatchNormalization._moments")
    batch_norm.build((None, 3))
    if list(getattr(batch_norm, "_reduction_axes", None) or []) != [0]:
        missing.append("BatchNormalization._reduction_axes")
    return missing
