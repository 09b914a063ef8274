"""Context parallelism: one sequence split over a mesh axis (`sequence_axis=`).

With `sequence_axis="seq"` on `DataParallel`, `ModelParallel` or `FSDP`, the
second dimension of every input and target array (tokens, padding masks,
labels, sample weights: `[batch, sequence, ...]`) is split along that mesh
axis as `fit`, `evaluate` and `predict` lay each batch out, beside the batch
axis on the first dimension. The activations stay split through the model:
per-token layers (embeddings, projections, norms, MLPs) compute on each
device's own chunk of tokens. Attention is the one place where tokens meet:
in each attention layer the query projection stays split and the key and
value projections are gathered whole along the axis (all-gather context
parallelism, MaxText's `context_parallel_strategy="all_gather"`), so each
device computes its own rows of the scores, `[batch, heads, sequence / N,
sequence]`, and holds the whole sequence only for the keys and values. The
backward pass reduces the keys' and values' gradients back onto their
chunks. Training is the same as on one device with the global batch: the
program is the same, laid out differently (XLA's SPMD partitioner inserts
the collectives).

Attention layers are found by their projections: a layer with a query, a
key and a value projection (`_query_dense`/`query_dense`, the same for key
and value), which Keras' `MultiHeadAttention` and KerasHub's decoders (Gemma,
Llama, Mistral, Qwen, GPT-2 through `MultiHeadAttention`, ...) have. A model
with none has nothing to split a sequence for: `ValueError` when the call
starts, before Keras builds or compiles anything (`check_model`).

A causal mask leaves half of the scores masked. Here each device computes
its rows against every key (XLA's attention, masked), so the work is the
same on every device whatever its chunk; nothing is skipped, so nothing is
to balance (ring attention that skips masked blocks would need the
load-balanced order MaxText and torchtitan use).

Splash (flash) attention on TPU is a Mosaic kernel XLA cannot partition: in
a call with a sequence axis longer than 1, an attention layer that leaves
the choice to the backend at each call (Keras' `MultiHeadAttention` made
without `flash_attention=True` while
`keras.config.is_flash_attention_enabled()` was None) runs XLA's attention
for that call (its setting False, `keras_compat.layers.xla_attention`, and
`keras.config.disable_flash_attention()` for layers that read the setting as
they call; both undone when the call ends). Keras' attention layers read
`keras.config` when they are made, so the global setting alone would leave
them as they were. Layers that call `keras.ops.dot_product_attention`
themselves with no `flash_attention` (KerasHub's Llama, Mistral, Gemma,
Qwen) leave the choice to Keras' JAX backend at each op, which would take
cuDNN's fused attention on a GPU that has it (its partitioning refuses a
query split along the sequence) or Splash on TPU: for the call the backend
is told it has no such kernel (`keras_internals.xla_attention_only`). A
layer built with `flash_attention=True` is refused, and so is an explicit
`flash_attention=True` reaching the op. On
an axis of size 1 nothing is split: every layer keeps its kernel
(`flash_attention=True` included), and the step compiles to the program it
has without the sequence axis.

JAX only: PyTorch and TensorFlow raise `NotImplementedError` at construction.
On PyTorch the error says what torch's own `context_parallel` lacks for Keras'
attention (`backends.torch.sequence`): ring attention only in CUDA's
scaled-dot-product-attention kernels, none on CPU, and no attention mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat.layers import (
    attention_projections,
    flash_attention_choice,
    layers_of,
    xla_attention,
)


def check_sequence_axis(sequence_axis: Any, device_mesh: Any, batch_axis: str) -> Any:
    """`sequence_axis` if it names an axis of `device_mesh` other than the
    batch axis (or is None); else `TypeError`/`ValueError`, and
    `NotImplementedError` on a backend other than JAX."""
    if sequence_axis is None:
        return None
    if not isinstance(sequence_axis, str):
        raise TypeError(
            "`sequence_axis` must be the name of a mesh axis, such as 'seq'. "
            f"Received: sequence_axis={sequence_axis!r}"
        )
    names = list(device_mesh.axis_names)
    others = [name for name in names if name != batch_axis]
    if sequence_axis not in names:
        raise ValueError(
            f"`sequence_axis` must be an axis of the mesh other than the batch "
            f"axis {batch_axis!r}: one of {others}, or build the mesh with one, "
            f"e.g. kd.DeviceMesh((2, 4), [{batch_axis!r}, {sequence_axis!r}]). "
            f"Received: sequence_axis={sequence_axis!r}"
        )
    if sequence_axis == batch_axis:
        # A mesh with a batch axis and a sequence axis of distinct names.
        sequence = sequence_axis if sequence_axis != "batch" else "seq"
        choices = f"one of {others}, or " if others else ""
        raise ValueError(
            "`sequence_axis` must differ from the batch axis: the batch is split "
            f"along one axis and each sequence along another. Pass {choices}"
            "a mesh with a batch axis and a sequence axis, e.g. "
            f"kd.DeviceMesh((2, 4), ['batch', {sequence!r}]) with "
            f"sequence_axis={sequence!r} (DataParallel splits the batch along the "
            "mesh's first axis: put the batch axis first). Received: "
            f"sequence_axis={sequence_axis!r}, batch axis={batch_axis!r}"
        )
    backend = keras.backend.backend()
    if backend != "jax":
        raise NotImplementedError(
            f"`sequence_axis` (context parallelism) runs on the JAX backend; "
            f"keras_dist does not split a sequence on {backend!r}. "
            + (_torch_why_not() if backend == "torch" else "")
            + "Use KERAS_BACKEND=jax, or drop `sequence_axis`."
        )
    return sequence_axis


def _torch_why_not() -> str:
    from keras_dist.backends.torch import sequence as torch_sequence  # noqa: PLC0415

    return torch_sequence.why_not()


def axis_size(device_mesh: Any, axis: str) -> int:
    return int(device_mesh.shape[list(device_mesh.axis_names).index(axis)])


def data_axes(
    shape: tuple[int, ...], batch_axis: str, sequence_axis: str | None, device_mesh: Any
) -> list[Any]:
    """The layout axes of an input array of `shape`: the batch axis on the
    first dimension and, with a sequence axis, that axis on the second
    (arrays of rank 2 or more whose second dimension is longer than 1).
    `ValueError` when the axis does not divide that dimension."""
    axes: list[Any] = [batch_axis] + [None] * (len(shape) - 1)
    if sequence_axis is None or len(shape) < 2 or shape[1] == 1:
        return axes
    parts = axis_size(device_mesh, sequence_axis)
    if shape[1] % parts:
        raise ValueError(
            f"The sequence axis {sequence_axis!r} splits each sequence into "
            f"{parts} equal chunks, but an input or target array of shape "
            f"{tuple(shape)} has {shape[1]} positions in its second dimension. "
            "Every input, target and sample-weight array of rank 2 or more is "
            "split along its second dimension. For sequences: pad them to a "
            f"multiple of {parts} (with a padding mask, e.g. a KerasHub "
            "preprocessor's `sequence_length=`), or use a sequence axis that "
            "divides them. For an array that is not a sequence (one-hot labels "
            "[batch, classes], features [batch, features]): give integer labels "
            "of shape [batch] with a sparse loss, or shape [batch, 1, ...]."
        )
    axes[1] = sequence_axis
    return axes


def check_output_layouts(layout_map: Any, sequence_axis: str | None) -> None:
    """`ValueError` for a layout map key that lays a layer's output out with
    the sequence dimension split another way than along `sequence_axis`."""
    if sequence_axis is None or layout_map is None:
        return
    for key in layout_map:
        if not key.endswith("output"):
            continue
        axes = tuple(layout_map[key].axes)
        if sequence_axis in axes[:1] + axes[2:] or (
            len(axes) > 1 and axes[1] not in (None, sequence_axis)
        ):
            raise ValueError(
                f"LayoutMap key {key!r} lays a layer's output out as {axes}, "
                f"but with sequence_axis={sequence_axis!r} the second dimension "
                f"of each activation ([batch, sequence, ...]) is split along "
                f"{sequence_axis!r} and no other dimension is. Give "
                f"(batch axis, {sequence_axis!r}, ...) or None there, or drop "
                "the key."
            )


def attention_layers(model: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The attention layers of `model` (those with a query, a key and a
    value projection), each with its projections by role."""
    found = []
    for layer in layers_of(model):
        projections = attention_projections(layer)
        if projections is not None:
            found.append((layer, projections))
    return found


def _wrap_call(layer: Any, constrain: Callable[[Any], Any]) -> Callable[[], None]:
    """Give `layer` (this object only) a `call` whose outputs pass through
    `constrain`; return what undoes it."""
    had_own = "call" in vars(layer)
    original = layer.call

    def call(*args: Any, **kwargs: Any) -> Any:
        return constrain(original(*args, **kwargs))

    object.__setattr__(layer, "call", call)

    def undo() -> None:
        if had_own:
            object.__setattr__(layer, "call", original)
        else:
            object.__delattr__(layer, "call")

    return undo


def _refuse_flash(layers: Any, distribution: Any) -> None:
    """`ValueError` for a layer built with `flash_attention=True` where the
    sequence axis splits (longer than 1)."""
    axis = distribution.sequence_axis
    if axis_size(distribution.device_mesh, axis) == 1:
        return
    for layer in layers:
        if flash_attention_choice(layer) is True:
            raise ValueError(
                f"Layer {layer.name!r} was built with flash_attention=True; its "
                f"kernel cannot be split along sequence_axis={axis!r} (XLA cannot "
                "partition a Mosaic kernel). Build it with flash_attention=None "
                "or False: under a sequence axis keras_dist runs XLA's attention."
            )


def _attention_or_raise(
    model: Any, distribution: Any
) -> list[tuple[Any, dict[str, Any]]]:
    axis = distribution.sequence_axis
    layers = attention_layers(model)
    if not layers:
        raise ValueError(
            f"sequence_axis={axis!r} splits each sequence over devices for a "
            f"model's attention, but {model.name!r} has no attention layer "
            "keras_dist knows (a layer with query, key and value projections: "
            "`_query_dense`/`query_dense`, `_key_dense`/`key_dense`, "
            "`_value_dense`/`value_dense`, as Keras' MultiHeadAttention and "
            "KerasHub's decoders have). Drop `sequence_axis` for this model."
        )
    _refuse_flash([layer for layer, _ in layers], distribution)
    return layers


def check_model(model: Any, distribution: Any) -> None:
    """Refuse, as a Keras call with `distribution` starts (before Keras
    builds or calls anything), a model `split_sequence` would refuse: a
    layer built with `flash_attention=True`, or a built model with no
    attention layer (an unbuilt one may make its projections when built:
    `split_sequence` then checks)."""
    axis = getattr(distribution, "sequence_axis", None)
    if axis is None or not isinstance(model, keras.Model):
        return
    layers = layers_of(model)
    _refuse_flash(layers, distribution)
    if all(layer.built for layer in layers):
        _attention_or_raise(model, distribution)


def split_sequence(model: Any, distribution: Any) -> Callable[[], None]:
    """Lay `model`'s attention out for `distribution.sequence_axis` for the
    call that starts (see the module); return what undoes it."""
    from keras_dist.backends.jax import sequence as jax_sequence  # noqa: PLC0415

    axis = distribution.sequence_axis
    layers = _attention_or_raise(model, distribution)
    mesh = distribution.device_mesh.backend_mesh
    batch = distribution.batch_dim_name
    undo: list[Callable[[], None]] = []

    def undo_all() -> None:
        while undo:
            undo.pop()()

    split = jax_sequence.constraint(mesh, batch, axis)
    whole = jax_sequence.constraint(mesh, batch, None)
    try:  # what was changed before a failure is undone with it
        for layer, projections in layers:
            undo.append(_wrap_call(projections["query"], split))
            undo.append(_wrap_call(projections["key"], whole))
            undo.append(_wrap_call(projections["value"], whole))
            undo.append(_wrap_call(layer, split))
        if axis_size(distribution.device_mesh, axis) == 1:
            return undo_all
        for layer, _ in layers:
            undo_kernel = xla_attention(layer)
            if undo_kernel is not None:
                undo.append(undo_kernel)
        if keras.config.is_flash_attention_enabled() is not False:
            keras.config.disable_flash_attention()
            undo.append(keras.config.enable_flash_attention)
        undo.append(jax_sequence.xla_attention_only(axis))
    except BaseException:
        undo_all()
        raise
    return undo_all
