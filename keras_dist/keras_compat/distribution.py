"""Keras' distribution base class, which Keras does not export."""

from __future__ import annotations

import keras

# Keras does not export the policies' base class; it is the common base of
# its DataParallel and ModelParallel.
KerasDistribution = keras.distribution.DataParallel.__mro__[1]


def check() -> list[str]:
    """What keras_dist's policies need from Keras' base class."""
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
    ):
        if not hasattr(KerasDistribution, name):
            missing.append(f"Distribution.{name}")
    return missing
