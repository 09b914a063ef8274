"""Keras' `fit`, `evaluate` and `predict`: what runs around each call."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import keras

# Keras' calls that hand the model to their callbacks (`CallbackList.set_model`).
MODEL_CALLS = ("fit", "evaluate", "predict")


def run_model_calls_within(around: Callable[[Any, str, Any, dict], Any]) -> None:
    """Run every model's `fit`, `evaluate` and `predict` inside the context
    manager `around(model, name, callbacks, arguments)` (`name`: `"fit"`,
    `"evaluate"` or `"predict"`; `callbacks`: what the call was given, None
    when nothing; `arguments`: the call's arguments by name, as given: `x`,
    `batch_size`, `verbose`...), from now on (idempotent).

    Keras tells callbacks when a call ends but not when it raises, so what a
    callback switched on for the call would outlive a call that raised;
    `around` can end it in its `finally`. Wrapping `keras.Model` covers
    Sequential, functional and subclassed models, and overrides that call
    `super().fit(...)`.
    """
    for name in MODEL_CALLS:
        original = getattr(keras.Model, name)
        if getattr(original, "_keras_dist_around", None) is not None:
            continue
        setattr(keras.Model, name, _call_within(original, name, around))


def _call_within(
    original: Callable[..., Any],
    name: str,
    around: Callable[[Any, str, Any, dict], Any],
) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = dict(signature.bind_partial(self, *args, **kwargs).arguments)
        except TypeError:  # Keras' own call raises the clear error
            bound = dict(kwargs)
        bound.pop("self", None)
        with around(self, name, bound.get("callbacks"), bound):
            return original(self, *args, **kwargs)

    call._keras_dist_around = around  # type: ignore[attr-defined]
    return call


def check() -> list[str]:
    """What `run_model_calls_within` needs."""
    missing = []
    for name in MODEL_CALLS:
        call = getattr(keras.Model, name, None)
        target = getattr(call, "__wrapped__", call)
        if (
            not callable(target)
            or "callbacks" not in inspect.signature(target).parameters
        ):
            missing.append(f"keras.Model.{name}(..., callbacks=...)")
    return missing
