"""The optimizer slots `keras_dist.plan` counts, from shapes only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras

from keras_dist.keras_compat.optimizers import slot_owners
from keras_dist.keras_compat.variables import shapes_only_variables

# Slots per trainable variable, each of the variable's shape and dtype, for
# Keras' optimizers, from their config. Used where a copy of the optimizer
# cannot be built on stand-ins (TensorFlow's optimizers take real variables
# only); tests/test_planner.py checks it against the built optimizers.
SLOT_TABLE: dict[str, Callable[[dict], list[str]]] = {
    "SGD": lambda c: ["momentum"] if c.get("momentum") else [],
    "Adam": lambda c: (
        ["momentum", "velocity"] + (["velocity_hat"] if c.get("amsgrad") else [])
    ),
    "AdamW": lambda c: (
        ["momentum", "velocity"] + (["velocity_hat"] if c.get("amsgrad") else [])
    ),
    "Adamax": lambda c: ["momentum", "norm"],
    "Nadam": lambda c: ["momentum", "velocity"],
    "Lion": lambda c: ["momentum"],
    "Lamb": lambda c: ["momentum", "velocity"],
    "Adagrad": lambda c: ["accumulator"],
    "Adadelta": lambda c: ["accumulated_grad", "accumulated_delta_var"],
    "Ftrl": lambda c: ["accumulator", "linear"],
    "RMSprop": lambda c: (
        ["velocity"]
        + (["momentum"] if c.get("momentum") else [])
        + (["average_gradient"] if c.get("centered") else [])
    ),
}


@dataclass(frozen=True)
class Slot:
    """An optimizer variable: path, shape, dtype, and the path of the model
    variable it mirrors (None for the optimizer's own scalars)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    owner: str | None


@dataclass
class _StandIn:
    """What an optimizer reads of a variable to build its slots."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def optimizer_slots(model: Any, optimizer: Any) -> tuple[list[Slot], str]:
    """The slots `optimizer` (default: the model's compiled one) creates for
    `model`'s trainable variables, and a note saying how they were counted."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return [], "No optimizer: the model is not compiled and none was given."
    else:
        optimizer = keras.optimizers.get(optimizer)
    stand_ins = [
        _StandIn(v.path, tuple(int(s) for s in v.shape), str(v.dtype))
        for v in model.trainable_variables
    ]
    name = type(optimizer).__name__
    try:
        # The copy's own scalars (iteration count, learning rate) are made
        # with values, which a stateless scope refuses; its slots are not.
        copy = type(optimizer).from_config(optimizer.get_config())
        with shapes_only_variables():
            copy.build(stand_ins)
    except Exception as error:  # any optimizer may refuse stand-ins its own way
        return _from_table(optimizer, stand_ins, error)
    owners = slot_owners(copy, stand_ins)
    slots = [
        Slot(
            v.path,
            tuple(int(s) for s in v.shape),
            str(v.dtype),
            owners[id(v)].path if id(v) in owners else None,
        )
        for v in copy.variables
    ]
    return slots, (
        f"Optimizer slots of {name}, counted by building a copy of it on the "
        "trainable variables' shapes without values; each slot follows its "
        "variable's layout."
    )


def _from_table(
    optimizer: Any, stand_ins: list[_StandIn], error: Exception
) -> tuple[list[Slot], str]:
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    name = type(inner).__name__
    config = inner.get_config()
    rule = SLOT_TABLE.get(name)
    if rule is None:
        return [], (
            f"Optimizer slots are not counted: a copy of {name} could not be "
            f"built on the variables' shapes ({type(error).__name__}: {error}) "
            f"and keras_dist's table knows {sorted(SLOT_TABLE)} only."
        )
    names = rule(config)
    if config.get("use_ema"):
        names = [*names, "average"]
    slots = [
        Slot(
            f"{inner.name}/{v.path.replace('/', '_')}_{slot}", v.shape, v.dtype, v.path
        )
        for v in stand_ins
        for slot in names
    ]
    return slots, (
        f"Optimizer slots of {name} from keras_dist's table ({len(names)} per "
        f"trainable variable: {names}), as this backend's optimizers cannot "
        "be built on shapes alone; each slot follows its variable's layout."
    )
