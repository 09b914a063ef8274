"""Keras' optimizer slots: which model variable each one mirrors, and the
moment each one is made."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def each_new_slot(optimizer: Any, made: Callable[[Any, Any], None]) -> Iterator[None]:
    """While the block runs, `made(reference, slot)` is called as soon as the
    optimizer makes a slot for a model variable
    (`Optimizer.add_variable_from_reference`, which every Keras optimizer's
    `build` uses), before the next one is made: FSDP shards each slot then,
    so the whole set is never held full size."""
    # One set on the instance before (by a user, or another hook) comes back.
    own = vars(optimizer).get("add_variable_from_reference")
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference: Any, *args: Any, **kwargs: Any) -> Any:
        slot = original(reference, *args, **kwargs)
        made(reference, slot)
        return slot

    optimizer.add_variable_from_reference = add_variable_from_reference
    try:
        yield
    finally:
        if own is None:
            del optimizer.add_variable_from_reference  # the class' method again
        else:
            optimizer.add_variable_from_reference = own


def check() -> list[str]:
    """What `slot_owners` and `each_new_slot` need."""
    import keras  # noqa: PLC0415

    dense = keras.layers.Dense(2, name="probe")
    dense.build((None, 3))
    sgd = keras.optimizers.SGD(momentum=0.9)
    seen: list[tuple[int, int]] = []
    with each_new_slot(sgd, lambda ref, slot: seen.append((id(ref), id(slot)))):
        sgd.build(dense.trainable_variables)
    missing = []
    if len(slot_owners(sgd, dense.trainable_variables)) != 2:
        missing.append("Optimizer.add_variable_from_reference slot naming")
    owners = slot_owners(sgd, dense.trainable_variables)
    expected = [(id(owners[id(s)]), id(s)) for s in sgd.variables if id(s) in owners]
    if sorted(seen) != sorted(expected):
        missing.append(
            "Optimizer.build makes its slots through self.add_variable_from_reference"
        )
    return missing
