"""Ready-made `LayoutMap`s: Megatron-style tensor parallelism, KerasHub backbones.

`tensor_parallel(model, mesh)` reads a built Keras model and writes one key per
variable of its Dense, EinsumDense, MultiHeadAttention, Embedding and Conv
layers; `for_keras_hub(backbone, mesh)` wraps a KerasHub backbone's own
`get_layout_map` and repairs the layouts its variables' shapes cannot take.
Both return a `PresetLayoutMap`, a keras_dist `LayoutMap` that also lists the
variables it left replicated, and why. Its keys name each variable by its path
in the model's own numbering of the layers Keras names automatically (the
model's first Dense `dense`, the next `dense_1`, whatever the process built
before), so that the map lays out every build of the same architecture: a
keras_dist distribution looks the paths of the model it trains up that way.

On PyTorch (DTensor, torch 2.13, measured on CPU) some splits cannot run; the
backend adapter names them (`unsupported_split`) and the presets replicate
those variables. Known further limits there: a convolution whose input arrives
split along its channels (after a split Embedding or a column-split Dense)
fails. (DTensor has no sharding rule for the backward of the CPU
flash-attention kernel either; keras_dist's sharded steps run attention
through torch's math kernel on CPU instead.)
"""

from __future__ import annotations

import re
from typing import Any

import keras

from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.distribution.layout_map import LayoutMap
from keras_dist.distribution.mesh import TensorLayout
from keras_dist.distribution.swapped_axes import model_width, swap, swapped_dimensions
from keras_dist.keras_compat.layers import layers_of

_COLUMN = "column"
_ROW = "row"
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


class PresetLayoutMap(LayoutMap):
    """A `LayoutMap` made by `tensor_parallel` or `for_keras_hub`.

    Its keys name variable paths in the model's own numbering of its
    automatically named layers: `^sequential/dense_1/kernel$` is the kernel
    of the model's second Dense whether this build calls it `dense_1` or
    `dense_6` (Keras counts every Dense the process made). Lookups take the
    paths of the model the map is bound to (`bind`: the model it was made
    from, then each model a keras_dist distribution holding it trains or
    plans), so the map lays out every build of the same architecture alike.
    It also records the variables the
    preset meant to split but left replicated (or, for KerasHub, split along
    fewer dimensions) because a mesh axis does not divide the dimension or
    the active backend cannot run the split.

    Attributes:
        replicated: `{variable path: reason}` for each such variable, in the
            order the model lists them (paths in the model's own numbering,
            as the keys).
        swapped: `{variable path: reason}` for each variable whose KerasHub
            layout has the model and data axes the wrong way round
            (keras-hub#2827) and that `for_keras_hub` lays out with them
            swapped back; empty for `tensor_parallel`.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1, 2), ["batch", "model"])
    >>> model = keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(3, name="head")], name="net"
    ... )
    >>> layout_map = keras_dist.layouts.tensor_parallel(model, mesh)
    >>> layout_map["net/head/kernel"].axes
    (None, None)
    >>> layout_map.replicated["net/head/kernel"]
    "dimension 1 of shape (4, 3) is 3, which the 'model' axis of size 2 does not divide"
    """

    keys_name_fresh_paths = True

    def __init__(self, device_mesh: Any = None):
        super().__init__(device_mesh)
        self.replicated: dict[str, str] = {}
        self.swapped: dict[str, str] = {}


def _check_model(model: Any, name: str) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{name}` must be a Keras model (keras.Model, Sequential or a "
            f"functional model). Received: {name}={model!r} of type "
            f"{type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            f"`{name}` must be built so that its variables have shapes: give it "
            "a `keras.Input`, call it on a batch, or call `model.build(shape)` "
            f"first. Received: the unbuilt model {model.name!r}"
        )


def _axis_size(mesh: Any, axis: Any, argument: str) -> int:
    names = list(mesh.axis_names)
    if axis not in names:
        raise ValueError(
            f"`{argument}` must be an axis of the mesh, one of {names}. "
            f"Received: {argument}={axis!r}"
        )
    return int(mesh.shape[names.index(axis)])


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "`mesh` must be a DeviceMesh (keras_dist's or Keras'), such as "
            "keras_dist.DeviceMesh((2, 4), ['batch', 'model']). Received: "
            f"mesh={mesh!r} of type {type(mesh).__name__}"
        )


def _anchored(path: str) -> str:
    """A key that matches `path` and nothing else."""
    return f"^{re.escape(path)}$"


def _children(layer: Any) -> list[Any]:
    """The layers `layer` holds directly, in the order it tracks them."""
    nested = layers_of(layer)[1:]
    deeper = {id(inner) for sub in nested for inner in layers_of(sub)[1:]}
    return [sub for sub in nested if id(sub) not in deeper]


def _variable(layer: Any, name: str) -> Any:
    """`layer`'s own variable called `name` (its `kernel`, `bias`...), or None."""
    for variable in layer.weights:
        if variable.name == name:
            return variable
    return None


def _einsum_letters(equation: str) -> tuple[str, str, str]:
    """The input, kernel and output letters of an EinsumDense equation."""
    inputs, rest = equation.replace("...", "").split(",")
    kernel, outputs = rest.split("->")
    return inputs, kernel, outputs


class _TensorParallel:
    """Walks a model's layers in order and lays out their variables."""

    def __init__(self, mesh: Any, axis: str, size: int):
        self.axis = axis
        self.size = size
        self.layout_map = PresetLayoutMap(mesh)
        self.next_split = _COLUMN
        self.seen: set[int] = set()

    def walk(self, layer: Any) -> None:
        for child in _children(layer):
            if id(child) in self.seen:
                continue
            self.seen.add(id(child))
            if isinstance(child, keras.layers.MultiHeadAttention):
                self._attention(child)
                self.next_split = _COLUMN
            elif isinstance(child, (keras.layers.Dense, keras.layers.EinsumDense)):
                self._dense(child, self.next_split)
                self.next_split = _ROW if self.next_split == _COLUMN else _COLUMN
            elif isinstance(child, keras.layers.Embedding):
                self._set(child, _variable(child, "embeddings"), 1)
                self.next_split = _COLUMN
            elif isinstance(child, _CONVOLUTIONS):
                kernel = _variable(child, "kernel")
                if kernel is not None:
                    self._set(child, kernel, len(kernel.shape) - 1)
                self._set(child, _variable(child, "bias"), 0)
                self.next_split = _COLUMN
            elif _children(child):
                self.walk(child)
            elif child.weights:
                # A normalization (or any layer with variables) between two
                # Dense layers needs their whole output: a new pair starts.
                self.next_split = _COLUMN

    def _attention(self, layer: Any) -> None:
        """Query, key, value (and gate) projections split on their heads
        (column), the output projection on its heads (row)."""
        output = layer.output_dense
        for child in _children(layer):
            if isinstance(child, keras.layers.EinsumDense) and child is not output:
                self.seen.add(id(child))
                self._dense(child, _COLUMN)
        self.seen.add(id(output))
        self._dense(output, _ROW)

    def _dense(self, layer: Any, split: str) -> None:
        kernel = _variable(layer, "kernel")
        bias = _variable(layer, "bias")
        if isinstance(layer, keras.layers.Dense):
            kernel_dim, bias_dim = (1, 0) if split == _COLUMN else (0, None)
        else:
            kernel_dim, bias_dim = self._einsum_dims(layer, split)
        self._set(layer, kernel, kernel_dim)
        self._set(layer, bias, bias_dim)

    @staticmethod
    def _einsum_dims(layer: Any, split: str) -> tuple[int | None, int | None]:
        """The kernel and bias dimensions an EinsumDense splits: its first
        output-only kernel letter (column) or first contracted one (row)."""
        inputs, kernel, outputs = _einsum_letters(layer.equation)
        if split == _ROW:
            contracted = [c for c in kernel if c in inputs and c not in outputs]
            return (kernel.index(contracted[0]) if contracted else None), None
        produced = [c for c in kernel if c in outputs and c not in inputs]
        if not produced:
            return None, None
        letter = produced[0]
        bias_axes = layer.bias_axes or ""
        if letter not in bias_axes:
            return kernel.index(letter), None
        # Keras' bias spans the output letters from the first bias letter on.
        first = min(outputs.index(c) for c in bias_axes)
        return kernel.index(letter), outputs[first:].index(letter)

    def _set(self, layer: Any, variable: Any, dim: int | None) -> None:
        """Key `layer`'s `variable` to a layout that splits `dim` (None:
        replicated)."""
        if variable is None:
            return
        path = self.layout_map.lookup_path(variable.path)
        key = _anchored(path)
        # Not `key in self.layout_map`: a Mapping's `in` is a lookup, which
        # searches the keys as regular expressions.
        if key in list(self.layout_map):
            return
        shape = tuple(variable.shape)
        axes: list[str | None] = [None] * len(shape)
        if dim is not None:
            if shape[dim] % self.size:
                self.layout_map.replicated[path] = (
                    f"dimension {dim} of shape {shape} is {shape[dim]}, which the "
                    f"{self.axis!r} axis of size {self.size} does not divide"
                )
            else:
                axes[dim] = self.axis
                refusal = get_adapter().unsupported_split(layer, variable, tuple(axes))
                if refusal is not None:
                    self.layout_map.replicated[path] = refusal
                    axes[dim] = None
        self.layout_map[key] = tuple(axes)


def tensor_parallel(
    model: keras.Model, mesh: Any, *, model_axis: str = "model"
) -> PresetLayoutMap:
    """A Megatron-style tensor-parallel `LayoutMap` for a built Keras model.

    The model's layers are read in order, nested models and layers included,
    and each variable below gets its own key, `^<variable path>$`, the path
    in the model's own numbering of its automatically named layers (see
    `PresetLayoutMap`: the same keys for every build of the model):

    - Dense and EinsumDense layers alternate a column split (kernel
      `(None, model_axis)`, bias `(model_axis,)`) and a row split (kernel
      `(model_axis, None)`, bias replicated), so a pair needs one all-reduce.
      A layer with variables of another kind in between starts a new pair.
      An EinsumDense splits its first kernel dimension that only the output
      has (column) or its first contracted one (row).
    - MultiHeadAttention: the query, key and value kernels and biases split
      on their heads dimension, the output kernel on its heads dimension (a
      row split, bias replicated). The next Dense starts a new pair.
    - Embedding: the embeddings split on the embedding (output) dimension.
    - Conv1D, Conv2D, Conv3D: kernels and biases split on output channels.

    A variable whose split dimension the axis does not divide, or whose split
    the active backend cannot run (on PyTorch, DTensor has no rules for split
    convolutions), is replicated (its key says so) and listed, with the
    reason, in the map's `replicated` attribute.
    Variables of other layers (normalizations, LoRA factors, ...) get no key,
    so `ModelParallel` replicates them.

    The pairing follows the order in which the model lists its layers; a
    model whose Dense layers are not a chain (e.g. a gated feed-forward block
    with two parallel input projections, or an attention layer of its own made
    of EinsumDense layers, as in KerasHub) gets a layout that trains the same
    but needs more communication than a hand-written one: for KerasHub
    backbones prefer `for_keras_hub`.

    Args:
        model: a built `keras.Model`.
        mesh: the `DeviceMesh` the layouts refer to.
        model_axis: the mesh axis to split variables along.

    Returns:
        A `PresetLayoutMap` on `mesh`.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1, 2), ["batch", "model"])
    >>> model = keras.Sequential(
    ...     [
    ...         keras.Input((4,)),
    ...         keras.layers.Dense(6, name="hidden"),
    ...         keras.layers.Dense(3, name="head"),
    ...     ],
    ...     name="net",
    ... )
    >>> layout_map = keras_dist.layouts.tensor_parallel(model, mesh)
    >>> list(layout_map)
    ['^net/hidden/kernel$', '^net/hidden/bias$', '^net/head/kernel$', '^net/head/bias$']
    >>> layout_map["net/hidden/kernel"].axes, layout_map["net/head/kernel"].axes
    ((None, 'model'), ('model', None))
    >>> distribution = keras_dist.ModelParallel(layout_map=layout_map)
    >>> model.fit(x, y, callbacks=[keras_dist.DistributeCallback(distribution)])
    """
    _check_model(model, "model")
    _check_mesh(mesh)
    size = _axis_size(mesh, model_axis, "model_axis")
    walker = _TensorParallel(mesh, model_axis, size)
    walker.layout_map.bind(model)
    walker.walk(model)
    return walker.layout_map


def _divisible_axes(shape: tuple, axes: tuple, mesh: Any) -> tuple[tuple, list[str]]:
    """`axes` with None wherever the axis does not divide the dimension, and a
    description of each such dimension."""
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    # Axes beyond the variable's rank, or not of the mesh, are left for
    # ModelParallel to refuse.
    fixed = list(axes) + [None] * (len(shape) - len(axes))
    problems = []
    for dim, axis in enumerate(fixed[: len(shape)]):
        if axis in sizes and shape[dim] % int(sizes[axis]):
            problems.append(
                f"dimension {dim} of shape {shape} is {shape[dim]}, which the "
                f"{axis!r} axis of size {sizes[axis]} does not divide"
            )
            fixed[dim] = None
    return tuple(fixed), problems


def _owners(model: Any) -> dict[int, Any]:
    """The innermost layer holding each variable of `model`, by `id`."""
    owners: dict[int, Any] = {}
    for layer in layers_of(model):  # parents before the layers they hold
        for variable in layer.weights:
            owners[id(variable)] = layer
    return owners


def for_keras_hub(
    backbone: keras.Model,
    mesh: Any,
    *,
    model_axis: str = "model",
    data_axis: str = "batch",
) -> PresetLayoutMap:
    """KerasHub's own `LayoutMap` for `backbone`, made safe for its shapes.

    Calls `type(backbone).get_layout_map(mesh, model_parallel_dim_name=
    model_axis, data_parallel_dim_name=data_axis)` and copies its keys,
    anchored (`^(?:key)$`), so that each matches the whole paths it matches in
    KerasHub's own map (Keras' `LayoutMap` uses `re.fullmatch`; keras_dist's
    searches, as the reference does) and no optimizer slot. A key that
    matches none of the backbone's variables is left out: KerasHub's maps
    name layers that some configurations lack (Qwen3-MoE's dense
    feed-forward layers, when every layer is a mixture of experts), and
    `keras_dist.plan` would report it as `unmatched-key`.

    Where KerasHub's layout puts the model axis on the model width (the
    backbone's `hidden_dim`) and the data axis on another dimension, the two
    are swapped back: KerasHub's Llama, Qwen and Qwen-MoE maps copy Gemma's
    `(model, data, None)` for the query/key/value kernels, whose dimensions
    are `(hidden, heads, head_dim)` there but `(heads, hidden, head_dim)` in
    Gemma (keras-hub#2827, closed unfixed), which would split the width
    along the model axis and the heads along the data axis. Such a variable
    gets an exact key with the swapped layout, is listed in `swapped`, and a
    warning names it; `keras_dist.plan` reports the unrepaired layout as
    `swapped-axes`. Where
    one of them puts an axis on a dimension the axis does not divide (for
    example a key/value kernel with one head over a model axis of 2,
    keras-hub#1613), that variable gets an exact key of its own (its path, which
    a lookup tries before the regular expressions) with None on that
    dimension, is listed in `replicated`, and a warning names it; so is a
    variable whose layout the active backend cannot run (on PyTorch: an
    embedding table split along its rows), which is replicated. Variables
    whose lookup the new keys would make ambiguous get exact keys too.

    A backbone class without a `get_layout_map` gets `tensor_parallel(backbone,
    mesh, model_axis=model_axis)` instead, with a warning.

    Args:
        backbone: a built KerasHub backbone (or any built `keras.Model`).
        mesh: the `DeviceMesh` to lay the variables out on.
        model_axis: the mesh axis KerasHub splits weights along.
        data_axis: the mesh axis KerasHub splits data (and some weights) along.

    Returns:
        A `PresetLayoutMap` on `mesh`.

    Example:

    >>> backbone = keras_hub.models.GemmaBackbone.from_preset("gemma_2b_en")
    >>> mesh = keras_dist.DeviceMesh((1, 8), ["batch", "model"])
    >>> layout_map = keras_dist.layouts.for_keras_hub(backbone, mesh)
    >>> distribution = keras_dist.ModelParallel(layout_map=layout_map)
    """
    _check_model(backbone, "backbone")
    _check_mesh(mesh)
    _axis_size(mesh, model_axis, "model_axis")
    _axis_size(mesh, data_axis, "data_axis")
    get_layout_map = getattr(type(backbone), "get_layout_map", None)
    hub_map = None
    if get_layout_map is not None:
        try:
            hub_map = get_layout_map(
                mesh,
                model_parallel_dim_name=model_axis,
                data_parallel_dim_name=data_axis,
            )
        except NotImplementedError:
            hub_map = None
    if hub_map is None:
        job.warn_once(
            f"{type(backbone).__name__} has no `get_layout_map` of its own; "
            "keras_dist.layouts.for_keras_hub uses "
            "keras_dist.layouts.tensor_parallel(backbone, mesh) instead.",
            UserWarning,
            stacklevel=2,
        )
        return tensor_parallel(backbone, mesh, model_axis=model_axis)
    layout_map = PresetLayoutMap(mesh)
    layout_map.bind(backbone)
    paths = [layout_map.lookup_path(variable.path) for variable in backbone.weights]
    for key in hub_map:
        if not any(re.fullmatch(key, path) for path in paths):
            continue  # a layer this configuration lacks: the key does nothing
        # Keras' LayoutMap (KerasHub's) matches whole paths (`re.fullmatch`),
        # keras_dist's searches in them: anchored, each key matches the same.
        layout_map[f"^(?:{key})$"] = TensorLayout(tuple(hub_map[key].axes), mesh)
    owners = _owners(backbone)
    width = model_width(backbone, [(v.path, tuple(v.shape)) for v in backbone.weights])
    intended: dict[str, tuple] = {}
    for variable in backbone.weights:
        path, shape = layout_map.lookup_path(variable.path), tuple(variable.shape)
        layout = hub_map[variable.path]
        axes = (None,) * len(shape) if layout is None else tuple(layout.axes)
        swapped = swapped_dimensions(shape, axes, width, data_axis)
        fixed = axes if swapped is None else swap(axes, *swapped)
        if swapped is not None:
            on_width, other = swapped
            layout_map.swapped[path] = (
                f"{axes[on_width]!r} on dimension {on_width}, the model width "
                f"(size {width}), and {data_axis!r} on dimension {other} of shape "
                f"{shape} are swapped (keras-hub#2827)"
            )
        intended[path], problems = _divisible_axes(shape, fixed, mesh)
        refusal = get_adapter().unsupported_split(
            owners.get(id(variable)), variable, intended[path]
        )
        if refusal is not None:
            intended[path] = (None,) * len(shape)
            problems.append(refusal)
        if problems:
            layout_map.replicated[path] = "; ".join(problems)
        if problems or swapped is not None:
            layout_map[path] = intended[path]
            reasons = (
                [layout_map.swapped[path]] if swapped is not None else []
            ) + problems
            job.warn_once(
                f"KerasHub's layout {axes} for {path!r} cannot be used: "
                f"{'; '.join(reasons)}. keras_dist lays it out as "
                f"{intended[path]} instead.",
                UserWarning,
                stacklevel=2,
            )
    _pin_ambiguous(layout_map, intended)
    return layout_map


def _pin_ambiguous(layout_map: PresetLayoutMap, intended: dict[str, tuple]) -> None:
    """Give an exact key to every path whose lookup the exact keys added for
    repaired variables (searched as regular expressions too) would make
    ambiguous or change."""
    changed = True
    while changed:
        changed = False
        for path, axes in intended.items():
            if path in list(layout_map):
                continue
            try:
                found = layout_map.layout_at(path)
            except ValueError:
                found = None
            else:
                found_axes = (None,) * len(axes) if found is None else found.axes
                found_axes = tuple(found_axes) + (None,) * (len(axes) - len(found_axes))
                if found_axes == axes:
                    continue
            layout_map[path] = axes
            changed = True
