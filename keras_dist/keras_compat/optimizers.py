"""Keras' optimizer slots: which model variable each one mirrors."""

from __future__ import annotations

from typing import Any


def slot_owners(optimizer: Any, model_variables: list[Any]) -> dict[int, Any]:
    """Map each optimizer slot (by `id`) to the model variable it mirrors.

    Keras names a slot `"<variable path with _ for />_<slot name>"` and gives
    it the variable's shape (`Optimizer.add_variable_from_reference`); the
    longest matching prefix of the same shape is the owner.
    """
    prefixes = [
        (variable.path.replace("/", "_") + "_", variable)
        for variable in model_variables
    ]
    prefixes.sort(key=lambda item: len(item[0]), reverse=True)
    owners: dict[int, Any] = {}
    for slot in optimizer.variables:
        for prefix, variable in prefixes:
            if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(
                variable.shape
            ):
                owners[id(slot)] = variable
                break
    return owners


def check() -> list[str]:
    """What `slot_owners` needs."""
    import keras  # noqa: PLC0415

    dense = keras.layers.Dense(2, name="probe")
    dense.build((None, 3))
    sgd = keras.optimizers.SGD(momentum=0.9)
    sgd.build(dense.trainable_variables)
    if len(slot_owners(sgd, dense.trainable_variables)) != 2:
        return ["Optimizer.add_variable_from_reference slot naming"]
    return []
