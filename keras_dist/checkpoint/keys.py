"""The checkpoint's variable keys: Keras' own `.weights.h5` structural paths."""

from __future__ import annotations

from typing import Any

import keras

from keras_dist.keras_compat.layers import (
    own_variables,
    seed_generators,
    unmerged_lora_variables,
)
from keras_dist.keras_compat.saving import (
    container_item_name,
    is_saveable,
    saveable_children,
)


def saveable_variables(model: Any) -> dict[str, Any]:
    """Every variable of `model`'s training state by Keras' `.weights.h5`
    structural path (`layers/dense/vars/0`, `optimizer/vars/3`), the same in
    every process and on every backend, unlike `variable.path`, whose
    auto-numbered names depend on what the process built before.

    Follows Keras' saving walk (`saving_lib._save_state`: same order, same
    names), reading each layer's own variables without copying them (Keras'
    optimizer saving would gather sharded ones), plus what `.weights.h5` leaves
    out: each layer's seed generators (`<layer>/seed_generators/<j>`, so
    Dropout goes on the same) and the metric states (`metrics/vars/<i>`).

    Example:

    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> sorted(saveable_variables(model))
    ['layers/dense/vars/0', 'layers/dense/vars/1']
    """
    found: dict[str, Any] = {}
    visited: set[int] = set()

    def own(saveable: Any, path: str) -> None:
        factors: dict[str, Any] = {}
        if isinstance(saveable, keras.optimizers.Optimizer):
            variables = list(saveable.variables)
        elif isinstance(saveable, keras.layers.Layer):
            if (
                type(saveable).save_own_variables
                is not keras.layers.Layer.save_own_variables
            ):
                recorded: dict[str, Any] = {}
                saveable.save_own_variables(recorded)
                variables, factors = unmerged_lora_variables(
                    saveable, list(recorded.values())
                )
                if not all(isinstance(v, keras.Variable) for v in variables):
                    raise NotImplementedError(
                        f"Layer {saveable.name!r} ({type(saveable).__name__}) saves "
                        "values that are not Keras variables in its own "
                        "save_own_variables; keras_dist checkpoints save variables "
                        "shard by shard and cannot save it. Save it with "
                        "model.save_weights instead."
                    )
            else:
                variables = own_variables(saveable)
            for j, generator in enumerate(seed_generators(saveable)):
                found[_join(path, f"seed_generators/{j}")] = generator.state
        else:
            return
        for i, variable in enumerate(variables):
            found[_join(path, f"vars/{i}")] = variable
        for name, variable in factors.items():  # LoRA's, by name: not in .weights.h5
            found[_join(path, f"vars/{name}")] = variable

    def walk(saveable: Any, path: str) -> None:
        if id(saveable) in visited:
            return
        own(saveable, path)
        visited.add(id(saveable))
        for attribute, child in saveable_children(saveable):
            if is_saveable(child):
                walk(child, _join(path, attribute))
            elif isinstance(child, list | dict | tuple):
                container(child, _join(path, attribute), set())

    def container(items: Any, path: str, seen: set[int]) -> None:
        if id(items) in seen:
            return
        seen.add(id(items))
        used: dict[str, int] = {}
        for item in list(items.values()) if isinstance(items, dict) else items:
            if is_saveable(item):
                walk(item, _join(path, container_item_name(item, used)))
            elif isinstance(item, list | dict | tuple):
                container(item, _join(path, container_item_name(item, used)), seen)

    walk(model, "")
    for i, variable in enumerate(model.metrics_variables):
        found[f"metrics/vars/{i}"] = variable
    return found


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name
