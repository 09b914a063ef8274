"""The optimizer's state in host memory, in a low-precision dtype (JAX).

A distribution's `state_placement` (`offload=`, `optimizer_state_dtype=`)
says where each state slot lives; here that is done. The optimizer's own
update runs (its `_backend_update_step`: what it keeps per step, as Nadam's
product of momentum factors or the loss scale, updated as in plain Keras),
and each `update_step` it calls, one per variable, is wrapped:

```
between steps   each slot's array: the sharding of its variable, with
                memory_kind="pinned_host" (offload), in the state dtype
in the step     for variable 1, 2, ... in turn (Keras' update_step each):
                  slots(i) host -> device        after slots(i-1) went back
                  cast up to float32             (optimization_barrier: XLA
                  update_step(grad(i), variable(i))   keeps the order, so one
                  cast down to the state dtype        variable's slots are on
                  slots(i) device -> host             the device at a time)
```

Under gradient accumulation each variable's transfers and update sit in one
branch of a `lax.cond` on the update step: the micro-steps between updates
move nothing (an update that also writes variables other than its own and
its slots, as Adafactor's factored moments, runs on every micro-step and
Keras keeps its result only on the update step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from keras import ops

from keras_dist.keras_compat import optimizers as keras_optimizers

HOST_MEMORY = "pinned_host"


def host_layout(layout: Any) -> Any:
    """`layout` (a Keras `TensorLayout` or a `NamedSharding`) in pinned host
    memory."""
    sharding = getattr(layout, "backend_layout", layout)
    return sharding.with_memory_kind(HOST_MEMORY)


def slot_layout(placement: Any, layout: Any) -> Any:
    """Where a state slot of a variable laid out as `layout` lives."""
    if placement is not None and placement.offloads_slots:
        return host_layout(layout)
    return layout


def slot_dtype_for(placement: Any) -> Callable[[Any], Any] | None:
    """The dtype a state slot is made in, from its reference variable, or
    None (Keras' own: the variable's)."""
    if placement is None or placement.optimizer_state_dtype is None:
        return None
    return lambda reference: placement.slot_dtype(reference.dtype)


def updating(optimizer: Any) -> list[Any]:
    """The optimizers that make and update the slots: a
    `LossScaleOptimizer`'s inner one (under `mixed_float16`), each of a
    `MultiOptimizer`'s, else `optimizer` itself."""
    return keras_optimizers.updating_optimizers(optimizer)


@contextlib.contextmanager
def each_new_slot(
    optimizer: Any, made: Callable, placement: Any, *, state_layout: Any = None
) -> Iterator[None]:
    """`made(reference, slot)` as each slot is made (`each_new_slot`) by
    every optimizer that makes them (`updating`), each state slot in the
    dtype `placement` says and made in `state_layout(reference)`."""
    with contextlib.ExitStack() as stack:
        for updating_one in updating(optimizer):
            stack.enter_context(
                keras_optimizers.each_new_slot(
                    updating_one,
                    made,
                    state_dtype=slot_dtype_for(placement),
                    state_layout=state_layout,
                )
            )
        yield


def check_built_slots(optimizer: Any, variables: list, placement: Any) -> None:
    """Refuse an optimizer built before in another state dtype (its slots
    cannot change dtype): naming the slot and what to do. Without a state
    dtype, slots narrower than their variable (left by an earlier run with
    one) are refused too: updated as they are, they would lose precision."""
    by_id = {id(variable): variable for variable in variables}
    if placement is None or placement.optimizer_state_dtype is None:
        for owner, slots in keras_optimizers.state_slots(optimizer, variables).items():
            wide = jax.numpy.dtype(by_id[owner].dtype).itemsize
            for slot in slots:
                if jax.numpy.dtype(slot.dtype).itemsize < wide:
                    raise ValueError(
                        f"The optimizer's slot {slot.path!r} is {slot.dtype}, "
                        f"narrower than its variable ({by_id[owner].dtype}): it "
                        "was built under optimizer_state_dtype. Pass the same "
                        "optimizer_state_dtype to this distribution, or compile "
                        "the model again (a new optimizer). Received: "
                        "optimizer_state_dtype=None"
                    )
        return
    for owner, slots in keras_optimizers.state_slots(optimizer, variables).items():
        wanted = placement.slot_dtype(by_id[owner].dtype)
        for slot in slots:
            if slot.dtype != wanted:
                raise ValueError(
                    f"optimizer_state_dtype={placement.optimizer_state_dtype!r} "
                    f"but the optimizer was built before with slot {slot.path!r} "
                    f"in {slot.dtype}. Compile the model again (a new optimizer) "
                    "before calling it under this distribution. Received: "
                    f"optimizer_state_dtype={placement.optimizer_state_dtype!r}"
                )


@contextlib.contextmanager
def stored_dtypes(model: Any, placement: Any) -> Iterator[None]:
    """While the block runs, the state slots of `model`'s optimizer have the
    dtype `placement` stores them in: a step compiled on abstract values
    (the plan's) for an optimizer built in its variables' dtype."""
    optimizer = getattr(model, "optimizer", None)
    if (
        placement is None
        or placement.optimizer_state_dtype is None
        or not (optimizer is not None and optimizer.built)
    ):
        yield
        return
    variables = model.trainable_variables
    slots = keras_optimizers.state_slots(optimizer, variables)
    with contextlib.ExitStack() as stack:
        for variable in variables:
            stack.enter_context(
                keras_optimizers.read_and_assigned_as(
                    slots.get(id(variable), []),
                    placement.slot_dtype(variable.dtype),
                )
            )
        yield


def install(optimizers: list, placement: Any) -> Callable[[], None]:
    """Have each of `optimizers`' updates keep its state as `placement`
    says, until the returned function is called (the steps traced meanwhile
    keep it). Keras' own update runs (`hook_updates`): only each variable's
    `update_step` is wrapped, its slots moved in and cast up before it,
    cast down and moved out after."""
    undo = [_install(optimizer, placement) for optimizer in optimizers]

    def uninstall() -> None:
        for each in reversed(undo):
            each()

    return uninstall


def check_updates(model: Any, distribution: Any, undo: Callable) -> None:
    """Under a state placement, trace one update of `model`'s built
    optimizer, on shapes only, with the hooks `install` set: an optimizer
    whose update does not go through `update_step` is refused here, when the
    call starts and before Keras hands the variables' values to the first
    step, after `undo(model)` (the activation undone: nothing left patched)."""
    optimizer = getattr(model, "optimizer", None)
    if (
        getattr(distribution, "state_placement", None) is None
        or optimizer is None
        or not optimizer.built
    ):
        return
    variables = model.trainable_variables

    def shapes(of: list) -> list:
        # Where each value lives (its memory kind) as the step will see it.
        return [
            jax.ShapeDtypeStruct(
                v.shape, v.value.dtype, sharding=getattr(v.value, "sharding", None)
            )
            for v in of
        ]

    try:
        jax.eval_shape(
            optimizer.stateless_apply,
            shapes(optimizer.variables),
            shapes(variables),
            shapes(variables),
        )
    except Exception:
        undo(model)
        raise


class _Apply:
    """One `apply`'s update: its slots, whether it is an update step (under
    gradient accumulation), the last variable's slots (the chain) and the
    variables updated so far."""

    def __init__(self, optimizer: Any, slots: dict, scope: Any) -> None:
        self.slots, self.scope = slots, scope
        self.is_update = None
        steps = optimizer.gradient_accumulation_steps
        if steps:
            counter = keras_optimizers.micro_step_counter(optimizer)
            iterations = scope.get_current_value(counter)
            self.is_update = (iterations + 1) % steps == 0
        self.previous: list[Any] = []
        self.updated: set[int] = set()


def _install(optimizer: Any, placement: Any) -> Callable[[], None]:
    groups: dict[tuple, dict[int, list[Any]]] = {}
    applying: list[_Apply] = []
    name = type(optimizer).__name__

    @contextlib.contextmanager
    def begin(grads: list, variables: list) -> Iterator[None]:
        key = tuple(id(variable) for variable in variables)
        if key not in groups:
            groups[key] = keras_optimizers.state_slots(optimizer, variables)
        current = _Apply(optimizer, groups[key], keras_optimizers.stateless_scope())
        applying.append(current)
        try:
            yield
        finally:
            applying.pop()
        missed = [
            variable.path
            for variable in variables
            if current.slots.get(id(variable)) and id(variable) not in current.updated
        ]
        if missed:
            raise NotImplementedError(
                f"{name}'s update does not call update_step for {missed}: "
                "offload= and optimizer_state_dtype= move and cast each "
                "variable's slots around its update_step, so its slots would "
                "be updated where and as they are stored. Train this optimizer "
                "without offload= and optimizer_state_dtype= (after "
                "optimizer_state_dtype=, compile the model again: its slots "
                "were made in that dtype)."
            )

    def each(
        update_step: Callable, grad: Any, variable: Any, learning_rate: Any
    ) -> None:
        if not applying:
            raise NotImplementedError(
                f"{name}.update_step was called outside its "
                "_backend_update_step: offload= and optimizer_state_dtype= "
                "wrap each variable's update within it. Train this optimizer "
                "without them."
            )
        current, scope = applying[-1], applying[-1].scope
        own = current.slots.get(id(variable), [])
        if placement.offloads_slots and current.previous and own:
            _after(scope, own, current.previous)
        step = _Update(update_step, placement, grad, variable, own, learning_rate)
        if current.is_update is None or not own or not step.only_own_state(scope):
            step.run_in(scope)
        else:
            step.run_on(scope, current.is_update)
        current.previous = own or current.previous
        current.updated.add(id(variable))

    return keras_optimizers.hook_updates(optimizer, begin, each)


def _after(scope: Any, slots: list, previous: list) -> None:
    """`slots`' values in `scope` made to wait until `previous`' are written
    back (one `optimization_barrier` over both): XLA then moves one
    variable's slots in only after the previous variable's went out."""
    values = [scope.get_current_value(slot) for slot in slots]
    written = [scope.get_current_value(slot) for slot in previous]
    values, written = jax.lax.optimization_barrier((values, written))
    for slot, value in [
        *zip(slots, values, strict=True),
        *zip(previous, written, strict=True),
    ]:
        scope.add_update((slot, value))


class _Update:
    """One variable's update with its slots brought in and written back."""

    def __init__(
        self,
        update_step: Callable,
        placement: Any,
        grad: Any,
        variable: Any,
        slots: list,
        learning_rate: Any,
    ) -> None:
        self.update_step, self.placement = update_step, placement
        self.grad, self.variable, self.slots = grad, variable, slots
        self.learning_rate = learning_rate
        # Each slot's stored dtype, and those updated in float32 (`narrow`).
        self.stored = {id(slot): placement.slot_dtype(variable.dtype) for slot in slots}
        self.narrow = set()
        if placement.optimizer_state_dtype is not None:
            self.narrow = {
                key for key, dtype in self.stored.items() if dtype != "float32"
            }

    def _narrow_slots(self) -> list:
        return [slot for slot in self.slots if id(slot) in self.narrow]

    def _computed(self, scope: Any, value: Any, slot_values: list) -> tuple:
        """The variable's and its slots' new values from these ones, the
        scope left as it was."""
        saved = keras_optimizers.scope_values(scope)
        scope.add_update((self.variable, value))
        for slot, slot_value in zip(self.slots, slot_values, strict=True):
            if self.placement.offloads_slots:
                slot_value = jax.device_put(slot_value, jax.memory.Space.Device)
            if id(slot) in self.narrow:
                slot_value = ops.cast(slot_value, "float32")
            scope.add_update((slot, slot_value))
        with keras_optimizers.read_and_assigned_as(self._narrow_slots(), "float32"):
            self.update_step(self.grad, self.variable, self.learning_rate)
        new_value = scope.get_current_value(self.variable)
        new_slots = []
        for slot in self.slots:
            slot_value = ops.cast(scope.get_current_value(slot), self.stored[id(slot)])
            if self.placement.offloads_slots:
                slot_value = jax.device_put(slot_value, jax.memory.Space.Host)
            new_slots.append(slot_value)
        self.changed = [
            key
            for key, held in keras_optimizers.scope_values(scope).items()
            if saved.get(key) is not held
            and key not in {id(self.variable), *map(id, self.slots)}
        ]
        keras_optimizers.restore_scope_values(scope, saved)
        return new_value, new_slots

    def _current(self, scope: Any) -> tuple:
        return (
            scope.get_current_value(self.variable),
            [scope.get_current_value(slot) for slot in self.slots],
        )

    def _store(self, scope: Any, value: Any, slot_values: list) -> None:
        scope.add_update((self.variable, value))
        for slot, slot_value in zip(self.slots, slot_values, strict=True):
            scope.add_update((slot, slot_value))

    def run_in(self, scope: Any) -> None:
        """The update, as Keras' own, on every step."""
        for slot in self.slots:
            value = scope.get_current_value(slot)
            if self.placement.offloads_slots:
                value = jax.device_put(value, jax.memory.Space.Device)
            if id(slot) in self.narrow:
                value = ops.cast(value, "float32")
            scope.add_update((slot, value))
        with keras_optimizers.read_and_assigned_as(self._narrow_slots(), "float32"):
            self.update_step(self.grad, self.variable, self.learning_rate)
        for slot in self.slots:
            value = ops.cast(scope.get_current_value(slot), self.stored[id(slot)])
            if self.placement.offloads_slots:
                value = jax.device_put(value, jax.memory.Space.Host)
            scope.add_update((slot, value))

    def only_own_state(self, scope: Any) -> bool:
        """Whether the update writes only its variable and slots (traced on
        shapes, nothing computed)."""
        jax.eval_shape(
            lambda *current: self._computed(scope, *current), *self._current(scope)
        )
        return not self.changed

    def run_on(self, scope: Any, is_update: Any) -> None:
        """The update (transfers included) only when `is_update`; otherwise
        the variable and its slots as they are."""
        value, slot_values = jax.lax.cond(
            is_update,
            lambda *current: self._computed(scope, *current),
            lambda *current: current,
            *self._current(scope),
        )
        self._store(scope, value, list(slot_values))
