"""Keras' rematerialization: the mode a layer recomputes its call with in the
backward pass (`keras.RematScope`), read and set on layers built before; the
call Keras recomputes, wrapped or replaced; and what such a call writes (its
variables' new values, its losses), carried out of a function transform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras.src.backend.common.stateless_scope import (
    StatelessScope,
    get_stateless_scope,
)

from keras_dist.keras_compat.layers import layers_of


def mode_of_scope(scope: Any) -> Any:
    """The mode a layer built inside `scope` (a `keras.RematScope`) gets."""
    from keras.src.backend.common.remat import get_current_remat_mode  # noqa: PLC0415

    with scope:
        return get_current_remat_mode()


def mode_of(layer: Any) -> Any:
    """`layer`'s own mode (None: its call is not rematerialized)."""
    return layer._remat_mode


def set_mode(layer: Any, mode: Any) -> None:
    """From now on `layer`'s call recomputes in backward as `mode` says (Keras
    reads it at each call, as if the layer had been built under the scope)."""
    layer._remat_mode = mode


#: Where a layer keeps its named remat policy (on the instance, past Keras'
#: attribute tracking).
_POLICY = "_keras_dist_remat_policy"


def policy_of(layer: Any) -> str | None:
    """The named policy of what `layer`'s recomputed call keeps for the
    backward pass (`"dots"`, `"offload"`; `"full"` or None: its inputs
    only). keras_dist's own setting beside Keras' mode."""
    return layer.__dict__.get(_POLICY)


def set_policy(layer: Any, policy: str | None) -> None:
    """From now on `layer`'s recomputed call keeps what `policy` names (None:
    its inputs only)."""
    if policy is None:
        layer.__dict__.pop(_POLICY, None)
    else:
        layer.__dict__[_POLICY] = policy


def _override_rematerialized_calls(
    layers: list[Any], make: Callable[[Any], Callable]
) -> Callable[[], None]:
    """`make(layer)` as each layer's `rematerialized_call` (Keras looks it up
    on the instance at each call of a layer with a mode); return the undo."""
    for layer in layers:
        # On the instance, past Keras' attribute tracking.
        layer.__dict__["rematerialized_call"] = make(layer)

    def undo() -> None:
        for layer in layers:
            layer.__dict__.pop("rematerialized_call", None)

    return undo


def wrap_recomputed_calls(
    layers: list[Any], wrap: Callable[[Any, Callable], Callable]
) -> Callable[[], None]:
    """While in effect, the call each of `layers` rematerializes (what Keras'
    `Layer.rematerialized_call` gets: the layer's `call`, run by activation
    checkpointing on the forward pass and again in backward) is
    `wrap(layer, call)`; return the undo."""

    def rematerialized(layer: Any) -> Callable:
        def rematerialized_call(layer_call: Callable, *args: Any, **kwargs: Any) -> Any:
            return type(layer).rematerialized_call(
                layer, wrap(layer, layer_call), *args, **kwargs
            )

        return rematerialized_call

    return _override_rematerialized_calls(layers, rematerialized)


def recompute_whole_calls(
    layers: list[Any], checkpoint: Callable[[Any, Callable], Callable]
) -> Callable[[], None]:
    """While in effect, a call of one of `layers` that Keras recomputes whole
    (its backend's `remat(call)`: modes `"full"`, `"list_of_layers"`, and
    `"larger_than"` past the threshold) runs `checkpoint(layer, call)`
    instead; Keras still decides whether it does. The mode `"activations"`
    (only the activation function recomputed) stays Keras' own. Return the
    undo."""

    def recomputed(layer: Any) -> Callable:
        def rematerialized_call(layer_call: Callable, *args: Any, **kwargs: Any) -> Any:
            keras_call = type(layer).rematerialized_call(
                layer, layer_call, *args, **kwargs
            )
            if keras_call is layer_call or layer._remat_mode.mode == "activations":
                return keras_call
            return checkpoint(layer, layer_call)

        return rematerialized_call

    return _override_rematerialized_calls(layers, recomputed)


class _RecordingScope(StatelessScope):
    """A stateless scope that also remembers which variables were written."""

    def __init__(self, caller: Any):
        super().__init__(collect_losses=caller is None or caller.collect_losses)
        if caller is not None:
            # The values the caller sees, the train step's among them.
            self.state_mapping.update(caller.state_mapping)
        self.written: dict[int, Any] = {}

    def add_update(self, update: Any) -> None:
        variable, _ = update
        self.written[id(variable)] = variable
        super().add_update(update)


class CallEffects:
    """What one call of `layer` writes into Keras' state (new values of
    variables: a seed generator's, moving statistics; losses of `add_loss`,
    activity regularizers), kept apart while the call runs inside a function
    transform such as `jax.checkpoint` (whose values must not stay in Keras'
    state once it returns) and put back, after it, from the values the
    transform handed out:

        effects = CallEffects(layer)
        def pure(...):                      # traced by the transform
            outputs, values, losses = effects.run(call, *args, **kwargs)
            return outputs, values, losses
        outputs, values, losses = transform(pure)(...)
        effects.put_back(values, losses)    # as the call itself would have

    Inside, the call sees the variables' values its caller sees (the train
    step's, in Keras' stateless scope)."""

    def __init__(self, layer: Any):
        self.layer = layer
        self._written: list[Any] = []
        self._loss_owners: list[tuple[Any, int]] = []

    def run(self, call: Callable, *args: Any, **kwargs: Any) -> tuple[Any, list, list]:
        """`call(*args, **kwargs)`: its outputs, the values it wrote (one per
        variable written) and the losses it added."""
        scope = _RecordingScope(get_stateless_scope())
        with scope:
            outputs = call(*args, **kwargs)
        self._written = list(scope.written.values())
        owners = layers_of(self.layer) if scope.losses else []
        self._loss_owners = []
        for loss in scope.losses:
            owner = next((o for o in owners if id(loss) in o._loss_ids), None)
            if owner is None:
                raise ValueError(
                    f"remat cannot recompute layer {self.layer.name!r} "
                    f"({type(self.layer).__name__}): its call adds a loss owned "
                    "by a layer that is neither it nor one of its sublayers, "
                    "which the recomputed call cannot hand back to its owner. "
                    "Leave the layer out of `remat` (keras.RematScope("
                    "mode='list_of_layers', layer_names=[...]) naming the "
                    "others), or make the layer that adds the loss an attribute "
                    "of it."
                )
            self._loss_owners.append((owner, id(loss)))
        values = [scope.get_current_value(variable) for variable in self._written]
        return outputs, values, list(scope.losses)

    def put_back(self, values: list[Any], losses: list[Any]) -> None:
        """Write `values` and add `losses` (what `run` returned, as they came
        out of the transform) as the call itself would have."""
        for variable, value in zip(self._written, values, strict=True):
            variable.assign(value)
        for (owner, inner), loss in zip(self._loss_owners, losses, strict=True):
            owner._loss_ids.discard(inner)
            owner.add_loss(loss)


def check() -> list[str]:
    """What `mode_of_scope`, `mode_of`, `set_mode`, the overrides of
    `rematerialized_call` and `CallEffects` need."""
    missing = []
    try:
        mode = mode_of_scope(keras.RematScope(mode="full"))
    except ImportError:
        return ["keras.src.backend.common.remat.get_current_remat_mode"]
    if getattr(mode, "mode", None) != "full":
        missing.append("get_current_remat_mode() -> RematMode(mode, ...)")
    with keras.RematScope(mode="full"):
        built_inside = keras.layers.Dense(2)
    plain = keras.layers.Dense(2)
    if getattr(built_inside, "_remat_mode", None) != mode or (
        getattr(plain, "_remat_mode", "absent") is not None
    ):
        missing.append("Operation._remat_mode")
    if not hasattr(plain, "rematerialized_call"):
        missing.append("Layer.rematerialized_call")
        return missing
    # A layer with a mode hands its call to `rematerialized_call` (looked up on
    # the instance), which `wrap_recomputed_calls` wraps.
    wrapped = []

    def wrap(layer: Any, call: Callable) -> Callable:
        wrapped.append(layer)
        return call

    undo = wrap_recomputed_calls([plain], wrap)
    try:
        set_mode(plain, mode)
        plain(keras.ops.ones((1, 3)))
    finally:
        set_mode(plain, None)
        undo()
    if wrapped != [plain] or "rematerialized_call" in plain.__dict__:
        missing.append("Operation.__call__ -> self.rematerialized_call(self.call)")
    # Keras hands back the call itself where it recomputes nothing, another
    # function where it recomputes the whole call.
    recomputed = []

    def checkpoint(layer: Any, call: Callable) -> Callable:
        recomputed.append(layer)
        return call

    undo = recompute_whole_calls([plain], checkpoint)
    try:
        for mode_name in ("full", "activations"):
            set_mode(plain, mode_of_scope(keras.RematScope(mode=mode_name)))
            plain(keras.ops.ones((1, 3)))
    finally:
        set_mode(plain, None)
        undo()
    if recomputed != [plain]:
        missing.append("Layer.rematerialized_call(call) -> remat(call) or call")
    return missing + _check_call_effects()


def _check_call_effects() -> list[str]:
    """A call's write and loss, run apart and put back into the scope around."""

    class Writes(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.count = self.add_weight(
                shape=(), initializer="zeros", trainable=False, name="count"
            )

        def call(self, inputs: Any) -> Any:
            self.count.assign(self.count + 1.0)
            self.add_loss(keras.ops.sum(inputs))
            return inputs

    layer = Writes()
    layer.build((2,))
    mapping = [(layer.count, keras.ops.convert_to_tensor(5.0))]
    with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        effects = CallEffects(layer)
        _, values, losses = effects.run(layer.call, keras.ops.ones((2,)))
        # New values, as a function transform hands them out.
        effects.put_back([v * 1 for v in values], [loss * 1 for loss in losses])
        count = scope.get_current_value(layer.count)
        added = layer.losses
    missing = []
    if count is None or float(count) != 6.0 or float(layer.count.value) != 0.0:
        missing.append("StatelessScope.state_mapping (values by id(variable))")
    if len(added) != 1 or float(added[0]) != 2.0:
        missing.append("StatelessScope.losses, Layer._loss_ids")
    return missing
