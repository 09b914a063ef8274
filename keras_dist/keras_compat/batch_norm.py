"""Keras' BatchNormalization: its moments (and, where a backend has one op for
it, its whole training-mode normalization) computed by keras_dist instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat.layers import layers_of


def replace_moments(
    model: Any,
    moments: Callable[..., Any],
    normalize: Callable[..., Any] | None = None,
) -> Callable[[], None]:
    """Make every BatchNormalization layer of `model` compute its training
    statistics with `moments(inputs, mask, axes=..., keras_moments=...,
    name=...)` (the signature of `GlobalBatchNorm.moments` past its first
    argument) instead of its own `_moments`; return the undo.

    With `normalize(inputs, axes=..., scale=..., offset=..., epsilon=...)`
    (`GlobalBatchNorm.normalize`'s), a layer in training mode with float32
    inputs, no mask and no renormalization first asks it for `(outputs, mean,
    variance)` and updates its moving statistics as Keras' `call` does; where
    it answers None, Keras' own `call` runs (with `moments`)."""
    layers = [
        layer
        for layer in layers_of(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    for layer in layers:
        # On the instance, past Keras' attribute tracking; the class' method
        # comes back when it is removed.
        layer.__dict__["_moments"] = _layer_moments(layer, moments)
        if normalize is not None:
            layer.__dict__["call"] = _layer_call(layer, normalize)

    def undo() -> None:
        for layer in layers:
            layer.__dict__.pop("_moments", None)
            layer.__dict__.pop("call", None)

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


def _layer_call(layer: Any, normalize: Callable[..., Any]) -> Callable[..., Any]:
    ops = keras.ops

    def layer_call(inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if (
            training
            and layer.trainable
            and mask is None
            and not layer.renorm
            and keras.backend.standardize_dtype(inputs.dtype) == "float32"
            and layer.compute_dtype == "float32"
            and layer.variable_dtype == "float32"
        ):
            normalized = normalize(
                inputs,
                axes=tuple(layer._reduction_axes),
                scale=ops.cast(layer.gamma, inputs.dtype) if layer.scale else None,
                offset=ops.cast(layer.beta, inputs.dtype) if layer.center else None,
                epsilon=layer.epsilon,
            )
            if normalized is not None:
                outputs, mean, variance = normalized
                # Keras' own update of the moving statistics (its `call`).
                moving_mean = ops.cast(layer.moving_mean, inputs.dtype)
                moving_variance = ops.cast(layer.moving_variance, inputs.dtype)
                layer.moving_mean.assign(
                    moving_mean * layer.momentum + mean * (1.0 - layer.momentum)
                )
                layer.moving_variance.assign(
                    moving_variance * layer.momentum + variance * (1.0 - layer.momentum)
                )
                return outputs
        return type(layer).call(layer, inputs, training=training, mask=mask)

    return layer_call


def check() -> list[str]:
    """What `replace_moments` needs."""
    missing = []
    batch_norm = keras.layers.BatchNormalization()
    if not callable(getattr(batch_norm, "_moments", None)):
        missing.append("BatchNormalization._moments")
    batch_norm.build((None, 3))
    if list(getattr(batch_norm, "_reduction_axes", None) or []) != [0]:
        missing.append("BatchNormalization._reduction_axes")
    for name in ("renorm", "momentum", "epsilon", "scale", "center"):
        if not hasattr(batch_norm, name):
            missing.append(f"BatchNormalization.{name}")
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        if not isinstance(getattr(batch_norm, name, None), keras.Variable):
            missing.append(f"BatchNormalization.{name} (a variable)")
    # A layer's call goes through its `call` attribute (Operation.__call__),
    # which `replace_moments(normalize=...)` sets on the instance.
    called = []

    def call(inputs: Any, training: Any = None, mask: Any = None) -> Any:
        called.append(training)
        return inputs

    batch_norm.__dict__["call"] = call
    try:
        batch_norm(keras.ops.ones((2, 3)), training=True)
    finally:
        batch_norm.__dict__.pop("call", None)
    if called != [True]:
        missing.append("Layer.__call__ calling the instance's `call`")
    return missing
