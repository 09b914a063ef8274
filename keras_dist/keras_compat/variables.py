"""Keras' variables built from shapes only (no value allocated)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras


@contextlib.contextmanager
def shapes_only_variables() -> Iterator[None]:
    """Variables created inside the block have a path, shape and dtype but no
    value: Keras defers their initialisation (`keras.StatelessScope`), and on
    exit they are dropped from Keras' list of variables to initialise later,
    so no later scope allocates them. Used by `keras_dist.plan`."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    name = "uninitialized_variables"
    before = {id(v) for v in global_state.get_global_attribute(name) or []}
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        pending = global_state.get_global_attribute(name)
        if pending:
            pending[:] = [v for v in pending if id(v) in before]


def check() -> list[str]:
    """What `shapes_only_variables` needs."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    with shapes_only_variables():
        probe = keras.Variable(initializer="zeros", shape=(2,), name="probe")
        pending = global_state.get_global_attribute("uninitialized_variables") or []
        registered = any(variable is probe for variable in pending)
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    if registered and all(variable is not probe for variable in pending):
        return []
    return ["global_state 'uninitialized_variables' (keras_dist.plan)"]
