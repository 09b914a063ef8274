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


def updating_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers that make and update the model's slots: a
    `LossScaleOptimizer`'s inner one, each of a `MultiOptimizer`'s, else
    `optimizer` itself."""
    import keras  # noqa: PLC0415

    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return updating_optimizers(inner)
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None and isinstance(optimizer, multi):
        return [o for sub in optimizer.optimizers for o in updating_optimizers(sub)]
    return [optimizer]


def hook_updates(
    optimizer: Any,
    begin: Callable[[list, list], contextlib.AbstractContextManager],
    each: Callable[[Callable, Any, Any, Any], None],
) -> Callable[[], None]:
    """Until the returned function is called, the optimizer's backend update
    (`_backend_update_step(grads, variables, learning_rate)`: Keras' own or
    its subclass', as Nadam's, which first updates its running product of
    momentum factors) runs as it is, inside `begin(grads, variables)`; and
    each `update_step(grad, variable, learning_rate)` it calls (Keras' base
    update calls it once per variable) is `each(update_step, grad, variable,
    learning_rate)`, `update_step` being the optimizer's own. So every state
    Keras keeps per step (iterations, Nadam's product, a loss scale) is
    updated by Keras, and only each variable's own update is wrapped."""
    backend_update = optimizer._backend_update_step
    update_step = optimizer.update_step
    own = {
        name: vars(optimizer).get(name)
        for name in ("_backend_update_step", "update_step")
    }

    def backend_update_step(grads: Any, variables: Any, learning_rate: Any) -> None:
        with begin(list(grads), list(variables)):
            backend_update(grads, variables, learning_rate)

    def each_update_step(grad: Any, variable: Any, learning_rate: Any) -> None:
        each(update_step, grad, variable, learning_rate)

    optimizer._backend_update_step = backend_update_step
    optimizer.update_step = each_update_step

    def undo() -> None:
        for name, held in own.items():
            if held is None:
                vars(optimizer).pop(name, None)
            else:
                setattr(optimizer, name, held)

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
    seen: list[Any] = []

    @contextlib.contextmanager
    def begin(grads: list, variables: list) -> Iterator[None]:
        scope = stateless_scope()
        seen.append(len(scope_values(scope)))
        group = slots[id(variables[0])]
        with read_and_assigned_as(group, "float32"):
            seen.append(group[0].dtype == "float32")
        yield

    def each(update_step: Callable, grad: Any, variable: Any, rate: Any) -> None:
        update_step(grad, variable, rate)

    undo = hook_updates(adam, begin, each)
    grads = [np.ones(v.shape, "float32") for v in dense.trainable_variables]
    adam.stateless_apply(
        [v.value for v in adam.variables],
        grads,
        [v.value for v in dense.trainable_variables],
    )
    undo()
    if seen[:1] != [len(adam.variables) + 2] or seen[1:] != [True]:
        missing.append("BaseOptimizer._backend_update_step in a StatelessScope")
    return missing + _check_every_optimizer_updates_through_update_step()


def _optimizers_to_probe() -> dict[str, Any]:
    """One of every optimizer class `keras.optimizers` exports, made with
    its defaults (the wrappers around an Adam and a Nadam)."""
    import keras  # noqa: PLC0415

    made: dict[str, Any] = {}
    for name in dir(keras.optimizers):
        cls = getattr(keras.optimizers, name)
        if not (
            isinstance(cls, type)
            and issubclass(cls, keras.optimizers.Optimizer)
            and cls is not keras.optimizers.Optimizer
        ):
            continue
        if name == "LossScaleOptimizer":
            made[name] = cls(keras.optimizers.Nadam())
        elif name == "MultiOptimizer":
            made[name] = cls(
                keras.optimizers.OptimizerMap(
                    keras.optimizers.Adam(), {"probe/bias": keras.optimizers.Nadam()}
                )
            )
        else:
            try:
                made[name] = cls()
            except TypeError:
                made[name] = None  # named by the check: add it to this probe
    return made


def _check_every_optimizer_updates_through_update_step() -> list[str]:
    """offload= and optimizer_state_dtype= wrap each variable's
    `update_step` inside the optimizer's own `_backend_update_step`
    (`hook_updates`): for every optimizer Keras exports, one stateless step
    so hooked must call `update_step` once for each variable, inside the
    backend update, and give exactly Keras' own results (per-step state such
    as Nadam's product of momentum factors or a loss scale included)."""
    missing = []
    for name, optimizer in _optimizers_to_probe().items():
        if optimizer is None:
            missing.append(f"keras.optimizers.{name}() (made with no arguments)")
        elif not _updates_through_update_step(optimizer):
            missing.append(
                f"keras.optimizers.{name}: its apply calls update_step once per "
                "variable inside _backend_update_step, as Keras' own step"
            )
    return missing


def _updates_through_update_step(optimizer: Any) -> bool:
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    dense = keras.layers.Dense(2, name="probe")
    dense.build((None, 3))
    variables = dense.trainable_variables
    optimizer.build(variables)
    grads = [np.full(v.shape, 0.5, "float32") for v in variables]
    state = [v.value for v in optimizer.variables]
    values = [v.value for v in variables]
    want = optimizer.stateless_apply(state, grads, values)
    calls: list[str] = []
    inside: list[bool] = []

    @contextlib.contextmanager
    def begin(grads: list, variables: list) -> Iterator[None]:
        inside.append(True)
        yield
        inside.pop()

    def each(update_step: Callable, grad: Any, variable: Any, rate: Any) -> None:
        calls.append(variable.path if inside else "outside")
        update_step(grad, variable, rate)

    undo = [hook_updates(o, begin, each) for o in updating_optimizers(optimizer)]
    try:
        got = optimizer.stateless_apply(state, grads, values)
    finally:
        for each_undo in undo:
            each_undo()
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip([*want[0], *want[1]], [*got[0], *got[1]], strict=True)
    )
    return same and sorted(calls) == sorted(v.path for v in variables)
