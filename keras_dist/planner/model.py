"""The model `keras_dist.plan` lays out: made from a function, built from an
input shape when it is not built, and the shapes of its layers' outputs for
inputs of a given shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from keras_dist.keras_compat.abstract_models import abstract_variables
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.variables import shapes_only_variables

#: How `plan` asks for what it needs to build a model, in its error messages.
BUILD_HINT = (
    "pass input_shape= (the shape of one sample, without the batch "
    "dimension, as keras.Input(shape=...) takes it: e.g. input_shape=(1024,), "
    "or a dict by input name for several inputs), give the model a "
    "keras.Input, or build it (call it on a batch, or model.build(...)) "
    "before planning"
)


class UnbuiltModelError(ValueError):
    """The model is not built and no `input_shape` says how to build it.

    Attributes:
        model_name: the model's name.
        model_type: the name of its class.
    """

    def __init__(self, model: Any):
        self.model_name = model.name
        self.model_type = type(model).__name__
        super().__init__(
            f"The model {self.model_name!r} ({self.model_type}) is not built, so "
            "its variables have no shapes yet and a plan of it would be empty: "
            f"{BUILD_HINT}. Received: input_shape=None"
        )


def made_model(model: Any, input_shape: Any) -> Any:
    """`model`, or what the function `model` returns, built: a function's
    model is made (and compiled, if the function compiles it) and built with
    no variable allocated but those made from a value (`abstract_variables`:
    an optimizer's learning rate, say); a
    model object that is not built is built as a call on a batch would build
    it, its variables getting values. Raises when there is nothing to build it
    from."""
    if not isinstance(model, keras.layers.Layer) and callable(model):
        with abstract_variables():
            made = _call(model)
            _check_is_model(made)
            return _built(made, input_shape)
    _check_is_model(model)
    return _built(model, input_shape)


def _call(function: Any) -> Any:
    return function()


def _check_is_model(model: Any) -> None:
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "`model` must be a Keras model or a function of no arguments "
            f"returning one. Received: model={model!r}"
        )


def _built(model: Any, input_shape: Any) -> Any:
    if model.built:
        return model
    if input_shape is None:
        raise UnbuiltModelError(model)
    shapes = _with_batch(input_shape)
    failure = None
    try:
        if isinstance(model, keras.Sequential):
            model.build(shapes)
            # Sequential.build returns quietly, marked built, on a shape it
            # cannot take (a dict, say).
            unbuilt = [layer.name for layer in model.layers if not layer.built]
            if unbuilt:
                failure = f"its layers {unbuilt} are still not built"
        else:
            # A subclassed model's `build` only marks it built; a symbolic
            # call builds every layer it calls.
            model(keras.tree.map_shape_structure(keras.KerasTensor, shapes))
    except Exception as error:  # whatever the model's own code raises
        raise ValueError(
            f"Building the model {model.name!r} from input_shape={input_shape!r} "
            f"(batch dimension added: {shapes!r}) failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    if failure is not None:
        raise ValueError(
            f"Building the model {model.name!r} from input_shape={input_shape!r} "
            f"(batch dimension added: {shapes!r}) failed: {failure}. A "
            "Sequential model takes the shape of its one input."
        )
    return model


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(
        size is None
        or (isinstance(size, (int, np.integer)) and not isinstance(size, bool))
        for size in value
    )


def check_input_shape(input_shape: Any) -> None:
    """Raise unless `input_shape` is None, a shape (ints or None), a list of
    shapes or a dict of shapes by input name."""
    if input_shape is None or _is_shape(input_shape):
        shapes = [] if input_shape is None else [input_shape]
    elif isinstance(input_shape, Mapping) and all(
        isinstance(k, str) for k in input_shape
    ):
        shapes = list(input_shape.values())
    elif isinstance(input_shape, (tuple, list)):
        shapes = list(input_shape)
    else:
        shapes = [None]
    for shape in shapes:
        if not _is_shape(shape):
            raise TypeError(
                "`input_shape` must be the shape of one sample without the batch "
                "dimension (a tuple of ints, None for any size, e.g. (1024,)), a "
                "list of them or a dict of them by input name. Received: "
                f"input_shape={input_shape!r}"
            )
        if any(size is not None and size < 1 for size in shape):
            raise ValueError(
                "Every size in `input_shape` must be at least 1 (or None for any "
                f"size). Received: input_shape={input_shape!r}"
            )


def _with_batch(input_shape: Any) -> Any:
    if _is_shape(input_shape):
        return (None, *input_shape)
    if isinstance(input_shape, Mapping):
        return {name: (None, *shape) for name, shape in input_shape.items()}
    return [(None, *shape) for shape in input_shape]


def unbuilt_layers(model: Any) -> list[str]:
    """The names of the layers of `model` that are not built."""
    return [layer.name for layer in layers_of(model)[1:] if not layer.built]


def input_structure(model: Any) -> Any:
    """The symbolic inputs of a functional model in their structure (a
    KerasHub backbone's dict), of a Sequential one as one tensor; None for a
    subclassed model."""
    for name in ("input", "inputs"):  # a Sequential has `inputs` only
        try:
            structure = getattr(model, name)
        except (AttributeError, ValueError):
            continue
        if isinstance(structure, list) and len(structure) == 1:
            return structure[0]
        return structure
    return None


def input_specs(model: Any, input_shape: Any, sequence_length: int | None) -> Any:
    """KerasTensors (batch dimension None) in the structure of `model.input`
    for `input_shape` or, with `sequence_length`, the model's own inputs with
    their unknown dimension 1 set to it; None for a model without symbolic
    inputs (subclassed) or when neither is given. Raises when they do not fit
    the model's inputs."""
    if input_shape is None and sequence_length is None:
        return None
    structure = input_structure(model)
    if structure is None:
        return None  # subclassed: the caller says there is no estimate
    flat = keras.tree.flatten(structure)
    if sequence_length is not None:
        return _with_sequence_length(structure, flat, sequence_length)
    named = dict(structure) if isinstance(structure, Mapping) else {}
    named = named or {tensor.name: tensor for tensor in flat}
    if _is_shape(input_shape) and len(named) == 1:
        given = {name: input_shape for name in named}
    elif isinstance(input_shape, Mapping) and set(input_shape) == set(named):
        given = dict(input_shape)
    elif (
        isinstance(input_shape, (tuple, list))
        and not _is_shape(input_shape)
        and not isinstance(structure, Mapping)
        and len(input_shape) == len(flat)
    ):
        given = {
            tensor.name: shape for tensor, shape in zip(flat, input_shape, strict=True)
        }
    else:
        shapes = {name: tuple(tensor.shape)[1:] for name, tensor in named.items()}
        raise ValueError(
            "`input_shape` must give one shape per input of the model: a shape "
            "for a model of one input, else a dict by input name (or a list, "
            f"in order, when the inputs are a list); the model's are {shapes}. "
            f"Received: input_shape={input_shape!r}"
        )
    specs = {
        name: _spec(tensor, given[name], input_shape) for name, tensor in named.items()
    }
    if isinstance(structure, Mapping):
        return specs
    return keras.tree.pack_sequence_as(
        structure, [specs[tensor.name] for tensor in flat]
    )


def _spec(tensor: Any, shape: Sequence[int | None], input_shape: Any) -> Any:
    expected = tuple(tensor.shape)[1:]
    fits = len(shape) == len(expected) and all(
        known is None or known == size
        for known, size in zip(expected, shape, strict=True)
    )
    if not fits:
        raise ValueError(
            f"`input_shape` does not fit the model's input {tensor.name!r}, whose "
            f"shape without the batch dimension is {expected} (None: any size). "
            f"Received: input_shape={input_shape!r}"
        )
    return keras.KerasTensor((None, *shape), dtype=tensor.dtype, name=tensor.name)


def _with_sequence_length(structure: Any, inputs: list[Any], length: int) -> Any:
    if not any(len(t.shape) >= 2 and t.shape[1] is None for t in inputs):
        raise ValueError(
            "`sequence_length` sets the unknown sequence dimension (dimension 1) "
            "of the model's inputs, and none of them has one: "
            f"{[tuple(t.shape) for t in inputs]}. Pass input_shape= instead. "
            f"Received: sequence_length={length}"
        )
    specs = []
    for tensor in inputs:
        shape = list(tensor.shape)
        if len(shape) >= 2 and shape[1] is None:
            shape[1] = length
        specs.append(
            keras.KerasTensor(tuple(shape), dtype=tensor.dtype, name=tensor.name)
        )
    return keras.tree.pack_sequence_as(structure, specs)


def traced_outputs(model: Any, specs: Any) -> list[Any]:
    """The outputs of every call of `model`'s top-level layers when the model
    runs, symbolically, on `specs`: each layer's `compute_output_spec` is
    wrapped, for the time of `model.compute_output_spec`, to record them."""
    recorded: list[Any] = []
    wrapped = []
    for layer in model.layers:
        if "compute_output_spec" in vars(layer):
            continue  # an instance that overrides it already: left alone
        original = layer.compute_output_spec

        def recording(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            outputs = _original(*args, **kwargs)
            recorded.extend(keras.tree.flatten(outputs))
            return outputs

        layer.compute_output_spec = recording
        wrapped.append(layer)
    try:
        with shapes_only_variables():
            model.compute_output_spec(specs)
    finally:
        for layer in wrapped:
            del layer.compute_output_spec
    return recorded


def unique_variables(variables: list[Any]) -> list[Any]:
    """`variables` without repeats (a variable two layers share), in order."""
    seen: dict[int, Any] = {}
    for variable in variables:
        seen.setdefault(id(variable), variable)
    return list(seen.values())


def output_paths(model: Any) -> list[str]:
    """`"<layer path>/output"` of every layer, the paths output keys match."""
    layers = layers_of(model) if isinstance(model, keras.layers.Layer) else [model]
    return [f"{layer.path}/output" for layer in layers if getattr(layer, "path", None)]


def output_tensors(model: Any) -> tuple[list[Any] | None, list[str]]:
    """The symbolic inputs and top-level layer outputs of a functional or
    Sequential model (None when subclassed), and the layers left out."""
    try:
        inputs = list(keras.tree.flatten(model.inputs))
    except (AttributeError, ValueError):
        return None, []
    tensors = {id(t): t for t in inputs}
    unknown = []
    for layer in model.layers:
        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError, RuntimeError):
            unknown.append(layer.name)
            continue
        for tensor in outputs:
            tensors.setdefault(id(tensor), tensor)
    return list(tensors.values()), unknown
