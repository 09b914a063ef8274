"""Keras' layer tree: nested layers, a functional graph's calls, the names
Keras numbers automatically."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import keras
from keras.src.utils.naming import to_snake_case


def layers_of(model: Any) -> list[Any]:
    """`model` and every layer in it, nested ones included."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def fresh_names(model: Any) -> dict[str, str]:
    """The names a fresh build of `model` gives its automatically named layers.

    Keras names a layer without a name `<class in snake case>`, then `_1`,
    `_2`... counting every such layer the process made before (`dense_5` in
    the second build of a model with five Dense layers). Returns `{name:
    fresh name}` for `model` and each layer in it whose name has that form,
    counted from `model` in the order it tracks its layers (the first Dense
    `dense`, the next `dense_1`), so that a path with each name replaced is
    the same for every build of the same architecture in any process.
    """
    counts: dict[str, int] = {}
    names: dict[str, str] = {}
    for layer in layers_of(model):
        base = to_snake_case(type(layer).__name__)
        if layer.name in names or not re.fullmatch(
            rf"{re.escape(base)}(?:_\d+)?", layer.name
        ):
            continue
        count = counts.get(base, 0)
        counts[base] = count + 1
        names[layer.name] = base if count == 0 else f"{base}_{count}"
    return names


def fresh_path(path: str, names: dict[str, str]) -> str:
    """`path` with each automatically numbered name in `names` (`fresh_names`)
    replaced by its fresh build's."""
    return "/".join(names.get(part, part) for part in path.split("/"))


def own_variables(layer: Any) -> list[Any]:
    """The variables `layer` itself created (not its sublayers'), trainable
    first, as Keras saves them."""
    return layer._trainable_variables + layer._non_trainable_variables


def unmerged_lora_variables(layer: Any, saved: list[Any]) -> tuple[list, dict]:
    """A LoRA-enabled layer's variables as a checkpoint must keep them.

    Keras' `save_own_variables` of a layer with `enable_lora` saves its kernel
    (or embedding table) with `a @ b` merged in, a tensor, and not the two
    factors, so training could not go on from it. Returns `saved` (what
    `save_own_variables` recorded, in its order) with that merged tensor
    replaced by the base variable (`_kernel`, `_embeddings`), and the LoRA
    factors by name (`lora_kernel_a`, ...). Anything else: `saved` unchanged
    and no factors.
    """
    if not getattr(layer, "lora_enabled", False):
        return saved, {}
    base = getattr(layer, "_kernel", None)
    if base is None:
        base = getattr(layer, "_embeddings", None)
    merged = [
        i for i, value in enumerate(saved) if not isinstance(value, keras.Variable)
    ]
    if not isinstance(base, keras.Variable) or len(merged) != 1:
        return saved, {}
    variables = list(saved)
    variables[merged[0]] = base
    factors = {
        variable.name: variable
        for variable in own_variables(layer)
        if variable.name.startswith("lora_")
    }
    return variables, factors


def own_non_trainable_variables(layer: Any) -> list[Any]:
    """The non-trainable variables `layer` itself created (moving statistics,
    say), not its sublayers'."""
    return list(layer._non_trainable_variables)


def seed_generators(layer: Any) -> list[Any]:
    """The `SeedGenerator`s `layer` itself holds (Dropout's, say)."""
    return list(getattr(layer, "_seed_generators", []))


def sublayers(layer: Any) -> list[Any]:
    """The layers `layer` holds directly (for `keras_dist.flops`)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def graph_calls(model: Any) -> dict[int, int] | None:
    """How many times `model`'s graph calls each layer, by `id`, for a
    functional model or a Sequential built as one; None for other layers."""
    from keras.src.models.functional import Functional  # noqa: PLC0415

    graph = getattr(model, "_functional", None) or model
    if not isinstance(graph, Functional):
        return None
    calls: dict[int, int] = {}
    for nodes in graph._nodes_by_depth.values():
        for node in nodes:
            calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    return calls


def grouped_attention_projections(layer: Any) -> dict[str, Any]:
    """The `EinsumDense` projections of a `GroupQueryAttention` layer."""
    return {
        "query": layer._query_dense,
        "key": layer._key_dense,
        "value": layer._value_dense,
        "output": layer._output_dense,
    }


#: An attention layer's projection attributes, by role: Keras'
#: `MultiHeadAttention` and `GroupQueryAttention` (`_query_dense`), KerasHub's
#: decoders (`_query_dense` or `query_dense`).
PROJECTIONS = {
    "query": ("_query_dense", "query_dense"),
    "key": ("_key_dense", "key_dense"),
    "value": ("_value_dense", "value_dense"),
}


def attention_projections(layer: Any) -> dict[str, Any] | None:
    """An attention layer's query, key and value projection layers by role,
    or None for a layer without all three (`PROJECTIONS`)."""
    found = {}
    for role, names in PROJECTIONS.items():
        found[role] = next(
            (
                getattr(layer, name)
                for name in names
                if isinstance(getattr(layer, name, None), keras.layers.Layer)
            ),
            None,
        )
    return found if all(found.values()) else None


def flash_attention_choice(layer: Any) -> bool | None:
    """What a Keras attention layer (`MultiHeadAttention`,
    `GroupQueryAttention`) keeps of flash attention from when it was made:
    True (`flash_attention=True`, or the layer's argument left None while
    `keras.config.is_flash_attention_enabled()` was True), False (that
    setting was False) or None (no choice: the backend picks a kernel at
    each call, flash attention where it can). Keras reads `keras.config`
    then, not at the call. None for a layer without the setting."""
    return getattr(layer, "_flash_attention", None)


def xla_attention(layer: Any) -> Callable[[], None] | None:
    """Make an attention layer that made no choice of flash attention
    (`flash_attention_choice` None) run the backend's plain attention until
    what is returned is called; None (nothing changed) for a layer that
    made a choice or has no such setting."""
    if not hasattr(layer, "_flash_attention") or layer._flash_attention is not None:
        return None
    layer._flash_attention = False

    def undo() -> None:
        layer._flash_attention = None

    return undo


def check() -> list[str]:
    """What `layers_of`, `fresh_names`, `own_variables`, `seed_generators`,
    `sublayers`, `graph_calls`, `grouped_attention_projections`,
    `attention_projections`, `flash_attention_choice` and `xla_attention`
    need."""
    missing = []
    named = [keras.layers.MultiHeadAttention(2, 2).name for _ in range(2)]
    if to_snake_case("MultiHeadAttention") != "multi_head_attention" or not all(
        re.fullmatch(r"multi_head_attention(?:_\d+)?", name) for name in named
    ):
        missing.append("keras.src.utils.naming: `<snake_case class>_<n>` names")
    model = keras.Sequential([keras.layers.BatchNormalization()])
    if not hasattr(model, "_flatten_layers"):
        missing.append("Layer._flatten_layers")
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    if not all(
        hasattr(dense, name)
        for name in (
            "_trainable_variables",
            "_non_trainable_variables",
            "_seed_generators",
        )
    ):
        missing.append("Layer._trainable_variables / Layer._seed_generators")
    inputs = keras.Input((3,))
    shared = keras.layers.Dense(3)
    model = keras.Model(inputs, shared(shared(inputs)))
    if (graph_calls(model) or {}).get(id(shared)) != 2:
        missing.append("Functional._nodes_by_depth nodes with .operation")
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    if graph_calls(sequential) is None:
        missing.append("Sequential._functional")
    if not set(map(id, sequential.layers)) <= set(map(id, sublayers(sequential))):
        missing.append("Layer._flatten_layers(include_self=False, recursive=False)")
    attention = keras.layers.GroupQueryAttention(2, 2, 1)
    attention.build((None, 4, 4), (None, 4, 4))
    try:
        projections = list(grouped_attention_projections(attention).values())
    except AttributeError:
        projections = []
    if [type(layer) for layer in projections] != [keras.layers.EinsumDense] * 4:
        missing.append("GroupQueryAttention._query_dense/_key_dense/...")
    for made in (
        keras.layers.MultiHeadAttention(2, 2, flash_attention=True),
        keras.layers.GroupQueryAttention(2, 2, 1, flash_attention=True),
    ):
        if getattr(made, "_flash_attention", None) is not True:
            missing.append(f"{type(made).__name__}._flash_attention")
    multi_head = keras.layers.MultiHeadAttention(2, 2)
    multi_head.build((None, 4, 4), (None, 4, 4))
    for made in (multi_head, attention):
        if attention_projections(made) is None:
            missing.append(
                f"{type(made).__name__}._query_dense/_key_dense/_value_dense"
            )
    return missing
