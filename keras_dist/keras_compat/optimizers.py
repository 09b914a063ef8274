"""Keras' optimizers: which model variable each slot mirrors, the moment each
slot is made, and the update run in pieces."""

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
def _on_instance(optimizer: Any, name: str, method: Callable) -> Iterator[None]:
    """`optimizer.<name>` is `method` while the block runs; then the class'
    method again, or what the instance itself held before (set by a user or
    another hook)."""
    own = vars(optimizer).get(name)
    setattr(optimizer, name, method)
    try:
        yield
    finally:
        if own is None:
            delattr(optimizer, name)
        else:
            setattr(optimizer, name, own)


@contextlib.contextmanager
def each_new_slot(optimizer: Any, made: Callable[[Any, Any], None]) -> Iterator[None]:
    """While the block runs, `made(reference, slot)` is called as soon as the
    optimizer makes a slot for a model variable
    (`Optimizer.add_variable_from_reference`, which every Keras optimizer's
    `build` uses), before the next one is made: FSDP shards each slot then,
    so the whole set is never held full size."""
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference: Any, *args: Any, **kwargs: Any) -> Any:
        slot = original(reference, *args, **kwargs)
        made(reference, slot)
        return slot

    with _on_instance(
        optimizer, "add_variable_from_reference", add_variable_from_reference
    ):
        yield


@contextlib.contextmanager
def update_in_pieces(
    optimizer: Any, most_bytes: int, size_of: Callable[[Any], int]
) -> Iterator[None]:
    """While the block runs, the optimizer's backend update
    (`BaseOptimizer._backend_update_step`: Keras' torch optimizers update all
    variables in one set of `torch._foreach_*` ops, whose temporaries are each
    as large as all the variables together) is called once per group of
    variables of at most `most_bytes` (`size_of(variable)` each; a larger
    variable is a group of its own). Each element is computed exactly as in
    one call (the ops are elementwise; the iteration count moves only after
    `apply`), so only the temporaries' peak changes: from a few times the
    process' share of the model to a few times one group."""
    original = optimizer._backend_update_step

    def in_pieces(grads: Any, variables: Any, learning_rate: Any) -> None:
        grads, variables = list(grads), list(variables)
        start, size = 0, 0
        for index, variable in enumerate(variables):
            nbytes = size_of(variable)
            if index > start and size + nbytes > most_bytes:
                original(grads[start:index], variables[start:index], learning_rate)
                start, size = index, 0
            size += nbytes
        if start < len(variables):
            original(grads[start:], variables[start:], learning_rate)

    with _on_instance(optimizer, "_backend_update_step", in_pieces):
        yield


def _check_update_in_pieces() -> list[str]:
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: PLC0415

    if "_backend_update_step" not in BaseOptimizer.__dict__:
        return ["BaseOptimizer._backend_update_step"]

    def fresh() -> list[Any]:
        return [keras.Variable(np.ones(n, "float32")) for n in (3, 2)]

    variables, copies = fresh(), fresh()
    whole, pieces = keras.optimizers.Adam(0.1), keras.optimizers.Adam(0.1)
    grads = [
        keras.ops.convert_to_tensor(np.full((3,), 0.5, "float32")),
        keras.ops.convert_to_tensor(np.full((2,), -0.25, "float32")),
    ]
    whole.apply(grads, variables)
    calls = []
    backend_update = pieces._backend_update_step

    def counted(*args: Any) -> None:
        calls.append(len(args[1]))
        backend_update(*args)

    pieces._backend_update_step = counted
    with update_in_pieces(pieces, 1, lambda variable: 4 * int(np.prod(variable.shape))):
        pieces.apply(grads, copies)
    if (
        calls != [1, 1]
        or any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(variables, copies, strict=True)
        )
        or np.array_equal(np.asarray(variables[0]), np.ones(3))
    ):
        return ["BaseOptimizer._backend_update_step (called once per apply, on lists)"]
    return []


def check() -> list[str]:
    """What `slot_owners`, `each_new_slot` and `update_in_pieces` need."""
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
    return missing + _check_update_in_pieces()
