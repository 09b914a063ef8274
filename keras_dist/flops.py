"""Model FLOPs per training step, counted from a Keras model's layers.

The count follows the convention of MFU figures (PaLM, appendix B; Megatron;
torchtitan): only the matrix multiplications and convolutions of the model
count, 2 FLOPs per multiply-add, and a training step is 3 forward passes
(the forward, then the backward's two products per weight: one for the
input's gradient and one for the weight's). Bias additions, activations,
normalization, pooling, softmax, dropout, embedding lookups and the optimizer
count as 0, and so do recomputations (`remat`): their work is not "model
FLOPs".

What is counted, per forward pass, with B the batch:

- `Dense`: `2 * m * n * k` for an `(m, n) x (n, k)` product, where m is the
  number of rows the layer sees (B, times any middle dimensions).
- `EinsumDense`: 2 times the product of the sizes of every index of its
  equation (each output element sums over the contracted indices).
- `Conv1D/2D/3D` (with `groups`), their `Transpose`, `DepthwiseConv1D/2D`,
  `SeparableConv1D/2D`: 2 times output positions times the kernel's
  multiply-adds per position (input positions for the transposed ones);
  with `padding="same"` the taps that fall on padding count too, as in most
  FLOP counters (XLA's cost analysis leaves them out).
- `SimpleRNN`, `GRU`, `LSTM`: per time step, `2 * B * (n + units) * g * units`
  with g = 1, 3, 4 gates. `Bidirectional` counts both directions,
  `TimeDistributed` its layer once per time step.
- `MultiHeadAttention`, `GroupQueryAttention`: their projections plus the
  two attention products (scores and weighted values, over every query and
  key position: masks, causal ones included, do not reduce the count).
- `ReversibleEmbedding` (KerasHub's tied input/output embedding): one
  reverse call (the output projection) per step, noted as an assumption.

Shapes come from each layer's build shapes (`layer.get_build_config()`), with
the first dimension taken as the batch. An unknown (`None`) dimension other
than the batch, such as a variable sequence length, is taken to be
`tokens_per_sample` when it is given; otherwise the layer is not counted.
A layer of another kind is never counted silently: one with no sublayers is
reported in `not_counted`; a custom layer or model with sublayers has its
sublayers counted, and a note says that the operations in its own `call` are
not. A layer called more than once in a functional graph (shared weights) is
counted once, with a note.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras

from keras_dist.common.validation import check_positive_int
from keras_dist.keras_compat.layers import (
    graph_calls,
    grouped_attention_projections,
    sublayers,
)

TRAINING_MULTIPLIER = 3


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """FLOPs of one training step of a model, and what they leave out.

    Attributes:
        forward: FLOPs of one forward pass over the batch.
        per_layer: forward FLOPs per counted layer, by layer path.
        not_counted: layers whose FLOPs are not in the count, by path, with
            the reason.
        notes: layers counted in part or under an assumption, by path.
    """

    forward: int
    per_layer: dict[str, int]
    not_counted: dict[str, str]
    notes: dict[str, str]

    @property
    def training(self) -> int:
        """FLOPs of one training step: 3 forward passes (see the module)."""
        return TRAINING_MULTIPLIER * self.forward

    def describe_gaps(self) -> str:
        """One line per layer left out or counted in part; empty when none."""
        lines = [
            f"not counted: {path}: {why}" for path, why in self.not_counted.items()
        ]
        lines += [f"note: {path}: {why}" for path, why in self.notes.items()]
        return "\n".join(lines)


def count_flops(
    model: Any, batch_size: int, *, tokens_per_sample: int | None = None
) -> FlopCount:
    """Count the FLOPs of one forward pass and one training step of `model`.

    Args:
        model: a built Keras model or layer.
        batch_size: rows per step: the global batch, to count the whole job's
            work.
        tokens_per_sample: the size of unknown (`None`) non-batch dimensions,
            such as the sequence length of a model built for any length.

    Returns:
        A `FlopCount`.

    Example:

    >>> dense = keras.layers.Dense(4)
    >>> dense.build((None, 3))
    >>> count_flops(dense, batch_size=2).forward  # 2 * 2 * 3 * 4
    48
    """
    check_positive_int("batch_size", batch_size, optional=False)
    check_positive_int("tokens_per_sample", tokens_per_sample, optional=True)
    counter = _Counter(batch_size, tokens_per_sample)
    counter.walk(model, scale=1)
    return FlopCount(
        forward=sum(counter.per_layer.values()),
        per_layer=counter.per_layer,
        not_counted=counter.not_counted,
        notes=counter.notes,
    )


class _Unknown(Exception):
    """A layer whose FLOPs cannot be counted; the message says why."""


def _public_layers(names: Sequence[str]) -> tuple[type, ...]:
    return tuple(
        getattr(keras.layers, name) for name in names if hasattr(keras.layers, name)
    )


# Layers whose work is not matrix multiplication: 0 by the convention above.
_ZERO = _public_layers(
    (
        "Activation",
        "ActivityRegularization",
        "Add",
        "AlphaDropout",
        "Average",
        "BatchNormalization",
        "CategoryEncoding",
        "CenterCrop",
        "Concatenate",
        "Discretization",
        "Dropout",
        "ELU",
        "Embedding",
        "Flatten",
        "GaussianDropout",
        "GaussianNoise",
        "GroupNormalization",
        "HashedCrossing",
        "Hashing",
        "Identity",
        "InputLayer",
        "IntegerLookup",
        "LayerNormalization",
        "LeakyReLU",
        "Masking",
        "Maximum",
        "Minimum",
        "Multiply",
        "Normalization",
        "PReLU",
        "Permute",
        "RMSNormalization",
        "ReLU",
        "RepeatVector",
        "Rescaling",
        "Reshape",
        "Resizing",
        "Softmax",
        "StringLookup",
        "Subtract",
        "TextVectorization",
        "UnitNormalization",
    )
    + tuple(
        name
        for name in dir(keras.layers)
        if name.startswith(
            (
                "AdaptiveAveragePooling",
                "AdaptiveMaxPooling",
                "AveragePooling",
                "Cropping",
                "GlobalAveragePooling",
                "GlobalMaxPooling",
                "MaxPooling",
                "Random",
                "SpatialDropout",
                "UpSampling",
                "ZeroPadding",
            )
        )
    )
)
_CONTAINERS = _public_layers(("Bidirectional", "Sequential"))
_RNN_GATES = (
    (keras.layers.LSTM, 4),
    (keras.layers.GRU, 3),
    (keras.layers.SimpleRNN, 1),
)
_CONV = _public_layers(("Conv1D", "Conv2D", "Conv3D"))
_CONV_TRANSPOSE = _public_layers(
    ("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose")
)
_DEPTHWISE = _public_layers(("DepthwiseConv1D", "DepthwiseConv2D"))
_SEPARABLE = _public_layers(("SeparableConv1D", "SeparableConv2D"))
_REVERSIBLE = _public_layers(("ReversibleEmbedding",))
_GROUPED_ATTENTION = _public_layers(("GroupQueryAttention",))


class _Counter:
    def __init__(self, batch_size: int, tokens_per_sample: int | None) -> None:
        self.batch_size = batch_size
        self.tokens_per_sample = tokens_per_sample
        self.per_layer: dict[str, int] = {}
        self.not_counted: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self._seen: set[int] = set()

    def walk(self, layer: Any, scale: int) -> None:
        if id(layer) in self._seen:
            return
        self._seen.add(id(layer))
        path = _path(layer)
        if isinstance(layer, _ZERO) and not isinstance(layer, _REVERSIBLE):
            return
        count = self._own_count(layer)
        if count is not None:
            try:
                flops = count(layer)
            except _Unknown as why:
                self.not_counted[path] = str(why)
            except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
                self.not_counted[path] = f"could not count {_kind(layer)}: {e}"
            else:
                self.per_layer[path] = self.per_layer.get(path, 0) + flops * scale
            return
        if isinstance(layer, keras.layers.TimeDistributed):
            try:
                steps = self._shape(layer)[1]
            except _Unknown as why:
                self.not_counted[path] = str(why)
                return
            self.walk(layer.layer, scale * steps)
            return
        children = sublayers(layer)
        if not children:
            self.not_counted[path] = (
                f"{_kind(layer)}: a layer of a kind keras_dist cannot count"
            )
            return
        calls = graph_calls(layer)
        if calls is None and not isinstance(layer, _CONTAINERS):
            self.notes[path] = (
                f"{_kind(layer)}: its sublayers are counted, the operations in "
                "its own call() are not"
            )
        for child in children:
            if calls and calls.get(id(child), 1) > 1:
                self.notes[_path(child)] = (
                    f"called {calls[id(child)]} times in {path}'s graph; counted once"
                )
            self.walk(child, scale)

    def _own_count(self, layer: Any) -> Callable[[Any], int] | None:
        if isinstance(layer, keras.layers.Dense):
            return self._dense
        if isinstance(layer, keras.layers.EinsumDense):
            return lambda einsum: self._einsum_dense(einsum, self._shape(einsum))
        if isinstance(layer, _CONV):
            return self._conv
        if isinstance(layer, _CONV_TRANSPOSE):
            return self._conv_transpose
        if isinstance(layer, _DEPTHWISE):
            return self._depthwise
        if isinstance(layer, _SEPARABLE):
            return self._separable
        if isinstance(layer, keras.layers.MultiHeadAttention):
            return self._multi_head_attention
        if isinstance(layer, _GROUPED_ATTENTION):
            return self._grouped_attention
        if isinstance(layer, _REVERSIBLE):
            return self._reversible_embedding
        for rnn_class, gates in _RNN_GATES:
            if isinstance(layer, rnn_class):
                return lambda rnn, gates=gates: self._rnn(rnn, gates)
        return None

    # -- shapes ----------------------------------------------------------------
    def _shape(self, layer: Any, key: str = "input_shape") -> tuple[int, ...]:
        config = layer.get_build_config() if layer.built else None
        if not config:
            raise _Unknown(f"{_kind(layer)} is not built: no input shape to count with")
        shape = config.get(key)
        if shape is None:
            shape = (config.get("shapes_dict") or {}).get(key)
        if shape is None:
            raise _Unknown(f"{_kind(layer)} has no {key} in its build config")
        return self._concrete(layer, shape)

    def _concrete(self, layer: Any, shape: Sequence[Any]) -> tuple[int, ...]:
        if not isinstance(shape, (list, tuple)) or not shape:
            raise _Unknown(
                f"{_kind(layer)} has input shape {shape!r}, not one tensor's"
            )
        dims = [self.batch_size]
        for dim in shape[1:]:
            if dim is None:
                if self.tokens_per_sample is None:
                    raise _Unknown(
                        f"{_kind(layer)} has input shape {tuple(shape)}: an unknown "
                        "dimension; pass tokens_per_sample= for its size"
                    )
                dim = self.tokens_per_sample
            dims.append(int(dim))
        return tuple(dims)

    # -- counts ----------------------------------------------------------------
    def _dense(self, layer: Any) -> int:
        shape = self._shape(layer)
        return 2 * math.prod(shape[:-1]) * shape[-1] * int(layer.units)

    def _einsum_dense(self, layer: Any, input_shape: tuple[int, ...]) -> int:
        output_shape = layer.compute_output_shape(input_shape)
        return einsum_flops(layer.equation, input_shape, output_shape)

    def _spatial(self, layer: Any, shape: Sequence[int]) -> tuple[list[int], int]:
        if layer.data_format == "channels_first":
            return list(shape[2:]), int(shape[1])
        return list(shape[1:-1]), int(shape[-1])

    def _conv(self, layer: Any) -> int:
        shape = self._shape(layer)
        _, channels = self._spatial(layer, shape)
        output = self._spatial(layer, layer.compute_output_shape(shape))[0]
        per_position = math.prod(layer.kernel_size) * channels // layer.groups
        return 2 * shape[0] * math.prod(output) * per_position * int(layer.filters)

    def _conv_transpose(self, layer: Any) -> int:
        shape = self._shape(layer)
        spatial, channels = self._spatial(layer, shape)
        per_position = math.prod(layer.kernel_size) * channels * int(layer.filters)
        return 2 * shape[0] * math.prod(spatial) * per_position

    def _depthwise(self, layer: Any) -> int:
        shape = self._shape(layer)
        _, channels = self._spatial(layer, shape)
        output = self._spatial(layer, layer.compute_output_shape(shape))[0]
        per_position = math.prod(layer.kernel_size) * channels * layer.depth_multiplier
        return 2 * shape[0] * math.prod(output) * per_position

    def _separable(self, layer: Any) -> int:
        shape = self._shape(layer)
        _, channels = self._spatial(layer, shape)
        output = self._spatial(layer, layer.compute_output_shape(shape))[0]
        middle = channels * layer.depth_multiplier
        per_position = math.prod(layer.kernel_size) * middle + middle * layer.filters
        return 2 * shape[0] * math.prod(output) * per_position

    def _rnn(self, layer: Any, gates: int) -> int:
        shape = self._shape(layer)
        if len(shape) != 3:
            raise _Unknown(
                f"{_kind(layer)} has input shape {shape}, not (batch, time, features)"
            )
        batch, steps, features = shape
        units = int(layer.units)
        return 2 * batch * steps * (features + units) * gates * units

    def _attention_shapes(self, layer: Any) -> tuple[tuple[int, ...], ...]:
        query = self._shape(layer, "query_shape")
        value = self._shape(layer, "value_shape")
        try:
            key = self._shape(layer, "key_shape")
        except _Unknown:
            key = value
        return query, key, value

    def _multi_head_attention(self, layer: Any) -> int:
        query, key, value = self._attention_shapes(layer)
        heads, key_dim = int(layer.num_heads), int(layer.key_dim)
        value_dim = int(layer.value_dim or key_dim)
        projections = sum(
            self._einsum_dense(dense, shape)
            for dense, shape in (
                (layer.query_dense, query),
                (layer.key_dense, key),
                (layer.value_dense, value),
                (layer.output_dense, (*query[:-1], heads, value_dim)),
            )
        )
        axes = layer.attention_axes or tuple(range(1, len(query) - 1))
        pairs = math.prod(query[1:-1]) * math.prod(key[axis] for axis in axes)
        return projections + 2 * query[0] * heads * pairs * (key_dim + value_dim)

    def _grouped_attention(self, layer: Any) -> int:
        query, key, value = self._attention_shapes(layer)
        heads, head_dim = int(layer.num_query_heads), int(layer.head_dim)
        dense = grouped_attention_projections(layer)
        projections = sum(
            self._einsum_dense(dense[name], shape)
            for name, shape in (
                ("query", query),
                ("key", key),
                ("value", value),
                ("output", (*query[:-1], heads, head_dim)),
            )
        )
        pairs = math.prod(query[1:-1]) * math.prod(key[1:-1])
        return projections + 2 * query[0] * heads * pairs * 2 * head_dim

    def _reversible_embedding(self, layer: Any) -> int:
        tokens = math.prod(self._shape(layer))
        self.notes[_path(layer)] = (
            "ReversibleEmbedding: counted as one reverse call (the output "
            "projection over every token) per step; the lookup counts 0"
        )
        return 2 * tokens * int(layer.input_dim) * int(layer.output_dim)


def einsum_flops(
    equation: str, input_shape: Sequence[int], output_shape: Sequence[int | None]
) -> int:
    """FLOPs of `einsum(equation, input, kernel)`: 2 times the product of the
    sizes of every index, each read from the input's shape or, for the
    kernel's indices that are not the input's, from the output's.

    Example:

    >>> einsum_flops("ab,bc->ac", (2, 3), (2, 4))  # a (2, 3) x (3, 4) product
    48
    """
    match = re.fullmatch(r"([a-zA-Z.]+),([a-zA-Z.]+)->([a-zA-Z.]+)", equation)
    if match is None:
        raise ValueError(f"Cannot read the einsum equation {equation!r}")
    lhs, rhs, out = match.groups()
    sizes: dict[str, int | None] = {}
    ellipsis = 1
    for is_input, subscripts, shape in (
        (True, lhs, input_shape),
        (False, out, output_shape),
    ):
        letters = subscripts.replace("...", "")
        if "..." in subscripts:
            extra = len(shape) - len(letters)
            before = subscripts.index("...")
            if is_input:
                ellipsis = math.prod(shape[before : before + extra])
            shape = (*shape[:before], *shape[before + extra :])
        if len(letters) != len(shape):
            raise ValueError(
                f"{equation!r}: {subscripts!r} does not match the shape {tuple(shape)}"
            )
        for letter, dim in zip(letters, shape, strict=True):
            if sizes.get(letter) is None:
                sizes[letter] = dim
    unknown = sorted(
        letter for letter in set(rhs.replace("...", "")) if sizes.get(letter) is None
    )
    if unknown:
        raise ValueError(
            f"{equation!r}: the size of the kernel's indices {unknown} is unknown"
        )
    return 2 * math.prod(int(size) for size in sizes.values() if size) * ellipsis


def _path(layer: Any) -> str:
    return getattr(layer, "path", None) or layer.name


def _kind(layer: Any) -> str:
    return type(layer).__name__
