"""Keras models made, compiled and built for training from shapes only.

The compiled plan (`keras_dist.plan(..., topology=...)`) compiles the step
`fit` runs for a model that may be far larger than this machine: its
variables must have a path, shape and dtype but no value. Keras defers the
initialisation of a variable made with an initializer inside a
`keras.StatelessScope` (`variables.shapes_only_variables`), but refuses one
made from a value, which `compile` makes (an optimizer's learning rate, say).
Inside `abstract_variables()` a variable made from a value is made as usual
(the value exists already: it is the caller's, and small), every other one is
deferred.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from keras.src.backend.common import global_state
from keras.src.backend.common import variables as common_variables

from keras_dist.keras_compat.variables import shapes_only_variables

_SCOPE = "stateless_scope"


@contextlib.contextmanager
def abstract_variables() -> Iterator[None]:
    """Variables made inside have no value unless they were given one.

    Example:

    >>> import keras
    >>> with abstract_variables():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> model.layers[0].kernel._value is None
    True
    """
    original = common_variables.Variable.__init__

    def made(self: Any, initializer: Any, *args: Any, **kwargs: Any) -> None:
        if callable(initializer) or isinstance(initializer, str):
            # An initializer (or its name): deferred, never allocated.
            original(self, initializer, *args, **kwargs)
            return
        scope = global_state.get_global_attribute(_SCOPE)
        global_state.set_global_attribute(_SCOPE, None)
        try:
            original(self, initializer, *args, **kwargs)
        finally:
            global_state.set_global_attribute(_SCOPE, scope)

    with shapes_only_variables():
        common_variables.Variable.__init__ = made
        try:
            yield
        finally:
            common_variables.Variable.__init__ = original


def build_for_training(model: Any, data_batch: Any) -> None:
    """Build what `fit` builds before its first step (the model, its compiled
    loss and metrics, its optimizer) from `data_batch`, a structure of
    objects with `shape` and `dtype` (the global batch), as Keras' `fit`
    does from its first batch. Call it inside `abstract_variables()`."""
    model._symbolic_build(data_batch=data_batch)


def check() -> list[str]:
    """What `abstract_variables` and `build_for_training` need."""
    missing = []
    if global_state.get_global_attribute(_SCOPE) is not None:
        return missing  # inside a scope: nothing to probe here
    import keras  # noqa: PLC0415

    with shapes_only_variables():
        if global_state.get_global_attribute(_SCOPE) is None:
            missing.append(f"global_state {_SCOPE!r} (keras_dist.plan(topology=))")
    try:
        with abstract_variables():
            value = keras.Variable(1.0, name="probe_value")
            deferred = keras.Variable(
                initializer="zeros", shape=(2,), name="probe_deferred"
            )
        if value._value is None or deferred._value is not None:
            missing.append("Variable.__init__ in a stateless scope (_value)")
    except (AttributeError, ValueError, TypeError):
        missing.append("Variable.__init__(initializer, ...) in a stateless scope")
    if not hasattr(keras.Model, "_symbolic_build"):
        missing.append("Trainer._symbolic_build")
    return missing
