"""The backend-neutral Keras details keras_dist relies on, in one place.

`tests/test_keras_internals.py` checks each of them, so a Keras release that
moves one fails that test loudly instead of breaking users quietly.
"""

from __future__ import annotations

import keras

# Keras does not export the policies' base class; it is the common base of
# its DataParallel and ModelParallel.
KerasDistribution = keras.distribution.DataParallel.__mro__[1]


def check() -> list[str]:
    """Names of the Keras details this release no longer matches."""
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
