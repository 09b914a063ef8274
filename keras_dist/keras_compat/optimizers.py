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


# Slots Keras' base optimizer makes from a variable for itself (`build`): they
# are not read by `update_step`, and are no state to offload or narrow.
BOOKKEEPING_SLOTS = ("gradient_accumulator", "average")


def is_state_slot(slot: Any) -> bool:
    """Whether an optimizer slot (or its name or path) is state its
    `update_step` keeps (Adam's moments, SGD's momentum), not a gradient
    accumulator or an EMA average."""
    name = slot if isinstance(slot, str) else slot.name
    return not str(name).endswith(tuple(f"_{n}" for n in BOOKKEEPING_SLOTS))


def state_slots(optimizer: Any, model_variables: list[Any]) -> dict[int, list[Any]]:
    """Each model variable's state slots (`is_state_slot`), by its `id`."""
    slots: dict[int, list[Any]] = {}
    owners = slot_owners(optimizer, model_variables)
    for slot in optimizer.variables:
        owner = owners.get(id(slot))
        if owner is not None and is_state_slot(slot):
            slots.setdefault(id(owner), []).append(slot)
    return slots


@contextlib.contextmanager
def each_new_slot(
    optimizer: Any,
    made: Callable[[Any, Any], None],
    *,
    state_dtype: Any = None,
    state_layout: Any = None,
) -> Iterator[None]:
    """While the block runs, `made(reference, slot)` is called as soon as the
    optimizer makes a slot for a model variable
    (`Optimizer.add_variable_from_reference`, which every Keras optimizer's
    `build` uses), before the next one is made: FSDP shards each slot then,
    so the whole set is never held full size. `state_dtype(reference)`, if
    given, is the dtype each state slot (`is_state_slot`) is made in, and
    `state_layout(reference)` (None: the reference's own) the layout it is
    made in (`add_variable(layout=)`): a slot kept in host memory is born
    there."""
    original = optimizer.add_variable_from_reference
    add_variable = optimizer.add_variable

    def add_variable_from_reference(*args: Any, **kwargs: Any) -> Any:
        # As Keras calls it: (reference_variable, name=None, initializer=...),
        # by position or keyword (Adafactor names `reference_variable=`).
        reference = args[0] if args else kwargs["reference_variable"]
        name = kwargs.get("name", args[1] if len(args) > 1 else None)
        chosen = {}
        if name not in BOOKKEEPING_SLOTS:
            if state_dtype is not None:
                chosen["dtype"] = state_dtype(reference)
            if state_layout is not None:
                chosen["layout"] = state_layout(reference)
        chosen = {key: value for key, value in chosen.items() if value is not None}
        if not chosen:
            slot = original(*args, **kwargs)
        else:

            def in_place(*inner: Any, **options: Any) -> Any:
                return add_variable(*inner, **{**options, **chosen})

            with _on_instance(optimizer, "add_variable", in_place):
                slot = original(*args, **kwargs)
        made(reference, slot)
        return slot

    with _on_instance(
        optimizer, "add_variable_from_reference", add_variable_from_reference
    ):
        yield


def update_each_variable(
    optimizer: Any, update: Callable[[list, list, Any], None]
) -> Callable[[], None]:
    """Have the optimizer's backend update (`_backend_update_step(grads,
    variables, learning_rate)`, which calls `update_step` once per variable)
    be `update(grads, variables, learning_rate)` until the returned function
    is called."""
    own = vars(optimizer).get("_backend_update_step")
    optimizer._backend_update_step = lambda g, v, lr: update(list(g), list(v), lr)

    def undo() -> None:
        if own is None:
            vars(optimizer).pop("_backend_update_step", None)
        else:
            optimizer._backend_update_step = own

    return undo


def micro_step_counter(optimizer: Any) -> Any:
    """The variable counting every `apply` (`Optimizer._iterations`), which
    `iterations` divides by `gradient_accumulation_steps`."""
    return optimizer._iterations


def stateless_scope() -> Any:
    """The `StatelessScope` a stateless update (`stateless_apply`) runs in,
    whose mapping from variables to values it reads and updates."""
    from keras.src.backend.common import stateless_scope as scopes  # noqa: PLC0415

    scope = scopes.get_stateless_scope()
    if scope is None:
        raise RuntimeError("No StatelessScope is active.")
    return scope


def scope_values(scope: Any) -> dict[int, Any]:
    """A copy of `scope`'s mapping (variable id to value), for `restore`."""
    return dict(scope.state_mapping)


def restore_scope_values(scope: Any, values: dict[int, Any]) -> None:
    scope.state_mapping.clear()
    scope.state_mapping.update(values)


@contextlib.contextmanager
def read_and_assigned_as(variables: list[Any], dtype: str) -> Iterator[None]:
    """While the block runs, `variables` read and assign in `dtype` (their
    `dtype` is it), so an update of a low-precision slot computes in float32
    throughout instead of rounding at each assign."""
    kept = [variable._dtype for variable in variables]
    for variable in variables:
        variable._dtype = dtype
    try:
        yield
    finally:
        for variable, old in zip(variables, kept, strict=True):
            variable._dtype = old


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
    return missing + _check_update_in_pieces() + _check_state_hooks()


def _check_state_hooks() -> list[str]:
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    dense = keras.layers.Dense(2, name="probe")
    dense.build((None, 3))
    adam = keras.optimizers.Adam(gradient_accumulation_steps=2)
    with each_new_slot(adam, lambda ref, slot: None, state_dtype=lambda ref: "float16"):
        adam.build(dense.trainable_variables)
    missing = []
    if keras.backend.backend() != "jax":
        # The state hooks run in JAX's stateless step alone (offload and
        # the state dtype are JAX's); other backends have no stateless_apply.
        return missing
    if not any(v is micro_step_counter(adam) for v in adam.variables):
        missing.append("Optimizer._iterations")
    slots = state_slots(adam, dense.trainable_variables)
    if sorted(len(group) for group in slots.values()) != [2, 2] or any(
        slot.dtype != "float16" for group in slots.values() for slot in group
    ):
        missing.append("Optimizer slots made by add_variable(dtype=) in build")
    seen = []

    def update(grads: list, variables: list, learning_rate: Any) -> None:
        scope = stateless_scope()
        seen.append(len(scope_values(scope)))
        group = slots[id(variables[0])]
        with read_and_assigned_as(group, "float32"):
            seen.append(group[0].dtype == "float32")
        for grad, variable in zip(grads, variables, strict=True):
            adam.update_step(grad, variable, learning_rate)

    undo = update_each_variable(adam, update)
    grads = [np.ones(v.shape, "float32") for v in dense.trainable_variables]
    adam.stateless_apply(
        [v.value for v in adam.variables],
        grads,
        [v.value for v in dense.trainable_variables],
    )
    undo()
    if seen[:1] != [len(adam.variables) + 2] or seen[1:] != [True]:
        missing.append("BaseOptimizer._backend_update_step in a StatelessScope")
    return missing
