"""Distribution policies: which layout each variable, tensor and batch gets."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.distribution.layout_map import LayoutMap, lora_axes, lora_base_path
from keras_dist.distribution.mesh import (
    TensorLayout,
    check_mesh,
    describe_mesh,
    one_axis_mesh,
    validate_axes_in_mesh,
)
from keras_dist.distribution.mixed_precision import check_mixed_precision
from keras_dist.distribution.placement import PlacesState, state_placement
from keras_dist.distribution.process_data import process_part
from keras_dist.distribution.remat import check_remat
from keras_dist.distribution.sequence import (
    check_output_layouts,
    check_sequence_axis,
    data_axes,
)
from keras_dist.keras_compat.data_adapters import (
    keras_builds_data_adapter,
)
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.runtime import api as runtime

DEFAULT_BATCH_DIM_NAME = "batch"


def same_mesh(first: Any, second: Any) -> bool:
    """Whether two meshes have the same shape, axis names and devices."""
    return first is second or describe_mesh(first) == describe_mesh(second)


class Distribution(PlacesState, KerasDistribution):
    """Base class of the policies: a mesh plus where data and variables go.

    Args:
        device_mesh: the `DeviceMesh` everything is laid out on.
        batch_dim_name: the mesh axis that splits the batch. Defaults to the
            mesh's first axis.
        auto_shard_dataset: whether keras_dist splits the input between
            processes. Set it to `False` when each process already reads its
            own part of the data.
        remat: keyword only. Activation checkpointing: recompute layers'
            activations in the backward pass instead of keeping them, for
            less memory at the cost of one more forward computation. A mode
            of `keras.RematScope` (`"full"`, `"activations"`, `"larger_than"`),
            a policy (`"dots"`, `"offload"`: `remat.REMAT_POLICIES`) or a
            `keras.RematScope` (`"list_of_layers"` with `layer_names`, a
            threshold). The model's layers get the mode for each call, as
            if built inside the scope; layers whose call updates state
            (Dropout, BatchNormalization) are left out, saying so, and
            `"full"` recomputes the outermost layers that qualify, each as
            one piece (a model inside the model, such as a KerasHub
            backbone, is looked into: its blocks are the pieces). Training
            is unchanged. JAX and PyTorch (TensorFlow: `NotImplementedError`).
        offload: keyword only. `"optimizer"`: the optimizer's slots in host
            memory between steps (see `PlacesState`; JAX only).
        optimizer_state_dtype: keyword only. The slots' dtype, e.g.
            `"bfloat16"`, updated in float32 (see `PlacesState`; JAX only).
        sequence_axis: keyword only. A mesh axis that splits each sequence
            (context parallelism): the second dimension of every input array
            is split along it, and attention gathers the keys and values
            (`distribution.sequence`; JAX only).
    """

    #: Capabilities the backend adapters read (they never ask for a type).
    #: Whether variables are split along the batch axis (FSDP).
    shards_variables_along_batch = False
    #: Whether keras_dist lays out this distribution's batches itself, inside
    #: a run; outside one (Keras building a model from a batch before the run
    #: starts) batches stay host arrays, which a compiled step places itself.
    lays_out_batches_itself = True
    #: Whether keras_dist lays out the variables that exist when a run starts
    #: (every backend) and, on PyTorch, every variable: Keras up to 3.15
    #: ignores a torch variable's layout, and Keras 3.16 would make it a
    #: DTensor at creation from a layout keras_dist's are not.
    lays_out_variables_itself = True

    def __init__(
        self,
        device_mesh: Any,
        batch_dim_name: str | None = None,
        auto_shard_dataset: bool = True,
        *,
        remat: Any = None,
        offload: Any = None,
        optimizer_state_dtype: Any = None,
        sequence_axis: Any = None,
    ):
        self._remat = check_remat(remat)
        self._state_placement = state_placement(offload, optimizer_state_dtype)
        self._device_mesh = check_mesh(device_mesh)
        if batch_dim_name is None:
            batch_dim_name = device_mesh.axis_names[0]
        if batch_dim_name not in device_mesh.axis_names:
            raise ValueError(
                f"`batch_dim_name` must be an axis of the mesh, one of "
                f"{list(device_mesh.axis_names)}. Received: "
                f"batch_dim_name={batch_dim_name!r}"
            )
        self._batch_dim_name = batch_dim_name
        self._sequence_axis = check_sequence_axis(
            sequence_axis, device_mesh, batch_dim_name
        )
        self.auto_shard_dataset = auto_shard_dataset
        self._num_processes = runtime.num_processes()
        self._process_id = runtime.process_id()
        # Keras refuses every input but tf.data when this is True, and shards
        # tf.data itself; keras_dist splits every input type between processes
        # as batches reach the devices, so Keras must not.
        self._is_multi_process = False

    @property
    def auto_shard_dataset(self) -> bool:
        """Whether keras_dist splits the input between processes.

        Reads False inside Keras' own data adapters: from Keras 3.16 they
        shard per process by themselves when it is True (by whole batches,
        unpadded), and keras_dist splits every global batch itself, so Keras
        must not as well (Keras 3.15's tf.data adapter asks
        `distribute_dataset`, which then returns the dataset unchanged)."""
        return self._auto_shard_dataset and not keras_builds_data_adapter()

    @auto_shard_dataset.setter
    def auto_shard_dataset(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                "`auto_shard_dataset` must be True or False. Received: "
                f"auto_shard_dataset={value!r}"
            )
        self._auto_shard_dataset = value

    @property
    def sequence_axis(self) -> str | None:
        """The mesh axis that splits each sequence (`sequence_axis=`), or None."""
        return self._sequence_axis

    @property
    def remat(self) -> Any:
        """The `keras.RematScope` whose mode layers are recomputed with in
        backward, or None (see `remat=`)."""
        return self._remat

    @property
    def mixed_precision(self) -> Any:
        """The `MixedPrecisionPolicy` of `ModelParallel` and `FSDP`
        (`mixed_precision=`), or None."""
        return getattr(self, "_mixed_precision", None)

    @property
    def num_model_replicas(self) -> int:
        """How many copies of the model see different data."""
        axis = list(self.device_mesh.axis_names).index(self.batch_dim_name)
        return int(self.device_mesh.shape[axis])

    def get_data_layout(self, data_shape: tuple[int, ...]) -> TensorLayout:
        """Batches are split along `batch_dim_name` (and their sequences
        along `sequence_axis`) and replicated otherwise."""
        data_shape = tuple(data_shape)
        if not data_shape:
            raise ValueError(
                "Input data must have a batch dimension; a scalar cannot be "
                f"split. Received: data_shape={data_shape}"
            )
        axes = data_axes(
            data_shape, self.batch_dim_name, self.sequence_axis, self.device_mesh
        )
        return TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable: Any) -> Any:
        """The variable's own layout if it has one, else `layout_for_variable`."""
        existing = getattr(variable, "_layout", None)
        if existing is not None:
            return existing
        return self.layout_for_variable(variable)

    def layout_for_variable(self, variable: Any) -> TensorLayout:
        """The layout this policy gives `variable`, whatever it had before."""
        return TensorLayout([None] * len(variable.shape), self.device_mesh)

    def get_tensor_layout(self, path: str) -> Any:
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this the global distribution inside the block.

        Models built inside get their variables laid out at creation. On
        TensorFlow the block is also the scope of the `tf.distribute` strategy
        that runs this distribution, so the variables are mirrored from the
        start.
        """
        with super().scope(), get_adapter().scope(self):
            yield

    def distribute_dataset(self, dataset: Any) -> Any:
        """This process' part of `dataset`, as Keras' `distribute_dataset`.

        Called directly (as Keras documents it) in a multi-process job with
        `auto_shard_dataset=True`, a batched `tf.data.Dataset` is split as
        Keras splits it: each global batch is rebatched into per-process
        pieces and every process keeps its own (`rebatch` and `shard`), so
        the processes get disjoint parts. Other input types raise
        `ValueError`, as in Keras; one process, or `auto_shard_dataset=False`,
        returns `dataset` unchanged.

        Inside `fit`, `evaluate` and `predict` Keras' data adapters leave the
        data whole (Keras 3.15's tf.data adapter gets it back unchanged from
        here, Keras 3.16's adapters read `auto_shard_dataset` as False):
        keras_dist splits every input type between processes itself, as
        batches reach the devices. So pass `fit` the global dataset, not this
        method's result.

        Example:

        ```python
        distribution = keras_dist.DataParallel()
        for x, y in distribution.distribute_dataset(dataset.batch(64)):
            ...  # this process' 64 / num_processes rows of each batch
        ```
        """
        return process_part(self, dataset)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} device_mesh={self.device_mesh}, "
            f"batch_dim_name={self.batch_dim_name!r}"
            + (
                f", sequence_axis={self.sequence_axis!r}>"
                if self.sequence_axis
                else ">"
            )
        )


class DataParallel(Distribution, keras.distribution.DataParallel):
    """Replicate the model on every device; split each batch between them.

    Args:
        device_mesh: a 1-D `DeviceMesh`. Give this or `devices`, not both.
        devices: device names to build a 1-D mesh from.
        auto_shard_dataset: see `Distribution`.
        sync_batch_norm: keyword only. `True` (the default): BatchNormalization
            normalizes over the real rows of the whole global batch, as one
            device would (PyTorch's `SyncBatchNorm`; Keras' `synchronized=True`
            on TensorFlow), at the cost of one small all-reduce per layer in
            forward and one in backward on PyTorch and TensorFlow. `False`: each
            replica normalizes with its own rows' statistics, as torch DDP and
            `tf.distribute` do by default (the moving statistics are still kept
            equal everywhere). On JAX the statistics are global either way, as
            in Keras' own `DataParallel`.
        remat: keyword only; see `Distribution`.

    With neither argument, every device of `list_devices()` is used.
    `offload=`, `optimizer_state_dtype=` and `sequence_axis=` (keyword only):
    see `Distribution` (with a sequence axis, a `("batch", "seq")` mesh).

    Example:

    >>> distribution = keras_dist.DataParallel(devices=["cpu:0"])
    >>> distribution.device_mesh.axis_names
    ['batch']
    """

    def __init__(
        self,
        device_mesh: Any = None,
        devices: Any = None,
        auto_shard_dataset: bool = True,
        *,
        sync_batch_norm: bool = True,
        remat: Any = None,
        offload: Any = None,
        optimizer_state_dtype: Any = None,
        sequence_axis: Any = None,
    ):
        if not isinstance(sync_batch_norm, bool):
            raise TypeError(
                "`sync_batch_norm` must be True or False. Received: "
                f"sync_batch_norm={sync_batch_norm!r}"
            )
        self._sync_batch_norm = sync_batch_norm
        device_mesh = one_axis_mesh(
            device_mesh, devices, DEFAULT_BATCH_DIM_NAME, "DataParallel"
        )
        names = list(device_mesh.axis_names)
        if (
            len(names) != 1
            and names[1:] != [sequence_axis]
            and names[0] != sequence_axis
        ):
            # (a sequence axis first is refused below, naming the fix)
            job.warn_once(
                f"DataParallel splits the batch along the first mesh axis "
                f"({device_mesh.axis_names[0]!r}) and replicates along the others; "
                f"use ModelParallel to shard variables. Received: a mesh of shape "
                f"{tuple(device_mesh.shape)}",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(
            device_mesh,
            device_mesh.axis_names[0],
            auto_shard_dataset,
            remat=remat,
            offload=offload,
            optimizer_state_dtype=optimizer_state_dtype,
            sequence_axis=sequence_axis,
        )

    @property
    def sync_batch_norm(self) -> bool:
        """Whether BatchNormalization uses the statistics of the global batch."""
        return self._sync_batch_norm


class ModelParallel(Distribution, keras.distribution.ModelParallel):
    """Shard variables as a `LayoutMap` says; split batches along one mesh axis.

    Args:
        device_mesh: the mesh. Defaults to the layout map's mesh; giving both
            and different ones is an error.
        layout_map: a `LayoutMap` (keras_dist's or Keras', e.g. from KerasHub's
            `Backbone.get_layout_map(mesh)`). Keys are variable paths, or
            `"<layer path>/output"` to relayout a layer's output. A layout
            with fewer axes than its variable has dimensions replicates the
            trailing ones, as in Keras (`("model",)` on a kernel is
            `("model", None)`); one with more axes is an error.
        batch_dim_name: the mesh axis that splits the batch. Defaults to the
            mesh's first axis.
        auto_shard_dataset: see `Distribution`.
        remat: keyword only; see `Distribution`.
        mixed_precision: keyword only. A `keras_dist.MixedPrecisionPolicy`
            (or its compute dtype, `"bfloat16"`): the float32 layers compute
            in that dtype for the calls under this distribution, their
            variables kept float32, and gradients are reduced in its
            `reduce_dtype`. None (the default): each layer as its own Keras
            dtype policy says.

    `offload=`, `optimizer_state_dtype=` and `sequence_axis=` (keyword only):
    see `Distribution`.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    >>> layout_map = keras_dist.LayoutMap(mesh)
    >>> layout_map["dense.*kernel"] = (None, "model")
    >>> distribution = keras_dist.ModelParallel(layout_map=layout_map)
    >>> distribution.batch_dim_name
    'batch'
    """

    def __init__(
        self,
        device_mesh: Any = None,
        layout_map: Any = None,
        batch_dim_name: str | None = None,
        auto_shard_dataset: bool = True,
        *,
        remat: Any = None,
        mixed_precision: Any = None,
        offload: Any = None,
        optimizer_state_dtype: Any = None,
        sequence_axis: Any = None,
    ):
        self._mixed_precision = check_mixed_precision(mixed_precision)
        if layout_map is None:
            raise ValueError(
                "ModelParallel needs `layout_map=`, a LayoutMap from variable "
                "paths to layouts."
            )
        if not isinstance(layout_map, keras.distribution.LayoutMap):
            raise TypeError(
                "`layout_map` must be a LayoutMap (keras_dist's or Keras'). "
                f"Received: layout_map={layout_map!r} of type "
                f"{type(layout_map).__name__}"
            )
        map_mesh = layout_map.device_mesh
        if device_mesh is None:
            device_mesh = map_mesh
        if device_mesh is None:
            raise ValueError(
                "ModelParallel needs a mesh: pass `device_mesh=` or build the "
                "LayoutMap with one."
            )
        check_mesh(device_mesh)
        if map_mesh is not None and not same_mesh(device_mesh, map_mesh):
            raise ValueError(
                "`device_mesh` and `layout_map.device_mesh` differ; pass one of "
                f"them. Received: device_mesh={describe_mesh(device_mesh)}, "
                f"layout_map.device_mesh={describe_mesh(map_mesh)}"
            )
        for key in layout_map:
            try:
                re.compile(key)
            except re.error as error:
                # Keras' own LayoutMap accepts any string and fails at lookup
                # with a bare `re.error` naming no key.
                raise ValueError(
                    f"LayoutMap keys are regular expressions; {key!r} is not a "
                    f"valid one ({error})."
                ) from None
            layout = layout_map[key]
            validate_axes_in_mesh(layout.axes, device_mesh)
        check_output_layouts(layout_map, sequence_axis)
        super().__init__(
            device_mesh,
            batch_dim_name,
            auto_shard_dataset,
            remat=remat,
            offload=offload,
            optimizer_state_dtype=optimizer_state_dtype,
            sequence_axis=sequence_axis,
        )
        self._layout_map = layout_map
        # A LoRA factor's kernel rank, by the kernel's path (`_lora_layout`).
        self._kernel_ranks: dict[str, int] = {}
        replicas = self.num_model_replicas
        if self._num_processes > replicas and self._num_processes % replicas != 0:
            raise ValueError(
                "With more processes than model replicas, the process count must "
                f"be a multiple of the replica count. Received: "
                f"num_processes={self._num_processes}, "
                f"num_model_replicas={replicas}"
            )

    @property
    def layout_map(self) -> Any:
        return self._layout_map

    def unmatched_keys(self, paths: list[str]) -> list[str]:
        """The `layout_map` keys that match none of `paths` (variable paths,
        and `"<layer path>/output"` for layer outputs): a typo or a key for
        another model, which would silently leave everything replicated."""
        if isinstance(self._layout_map, LayoutMap):
            paths = [self._layout_map.lookup_path(path) for path in paths]
        return [
            key
            for key in self._layout_map
            if not any(key == path or re.search(key, path) for path in paths)
        ]

    def _on_mesh(self, layout: Any) -> Any:
        if layout is None or layout.device_mesh is not None:
            return layout
        return TensorLayout(layout.axes, self.device_mesh)

    def layout_for_variable(self, variable: Any) -> Any:
        layout = self._on_mesh(self._layout_map[variable.path])
        if layout is None:
            layout = self._lora_layout(variable)
        if layout is None:
            return super().layout_for_variable(variable)
        rank = len(variable.shape)
        if len(layout.axes) > rank:
            raise ValueError(
                f"The layout for {variable.path!r} has {len(layout.axes)} axes "
                f"{layout.axes} but the variable has shape {tuple(variable.shape)}. "
                "Give at most one mesh axis or None per dimension."
            )
        if len(layout.axes) < rank:
            # As in Keras and JAX: the missing trailing dimensions are
            # replicated. Spelled out, every backend sees one axis per dimension.
            axes = (*layout.axes, *([None] * (rank - len(layout.axes))))
            layout = TensorLayout(axes, layout.device_mesh)
        return layout

    def _lora_layout(self, variable: Any) -> Any:
        """A LoRA factor no key lays out: its kernel's layout on the
        dimensions they share (`layout_map.lora_axes`), else None."""
        base = lora_base_path(variable.path)
        kernel = None if base is None else self._on_mesh(self._layout_map[base])
        if kernel is None:
            return None
        rank = len(variable.shape)
        if variable.path.endswith("lora_kernel_a"):
            # The kernel has the rank of its factor `a`, made first.
            self._kernel_ranks[base] = rank
        kernel_rank = self._kernel_ranks.get(base, len(kernel.axes))
        axes = lora_axes(variable.path, rank, tuple(kernel.axes), kernel_rank)
        return TensorLayout(axes, self.device_mesh)

    def get_tensor_layout(self, path: str) -> Any:
        return self._on_mesh(self._layout_map[path])


class FSDP(ModelParallel):
    """Fully sharded data parallelism (ZeRO-3): every large variable split
    along the data axis, batches split along the same axis.

    Each variable with at least `min_size` elements and a floating dtype is
    split into equal parts along `axis`, on its largest dimension that the
    axis divides (the first such dimension on a tie) and that the
    `layout_map` does not already lay out; its optimizer slots (Adam's
    moments, SGD's momentum) follow it, and so do its gradients. Each
    device then holds 1/N of the parameters and optimizer state. A forward
    pass gathers each layer's weights where they are used and the backward
    pass reduces each gradient onto its owner's part: on JAX through
    shardings (XLA inserts the all-gathers and reduce-scatters), on PyTorch
    with the shards held as DTensors, one process per device: for the batch
    axis alone each layer computes on plain tensors as FSDP2 does (its weights
    gathered for its forward and again for its backward), with a model axis
    through DTensor. Training is the same as on one device with the global
    batch.

    Smaller variables (biases, norms), integer ones (seed states, counters)
    and those with no dimension that the axis divides stay replicated along
    `axis`; `kd.plan(model, distribution)` lists which.

    Composes with tensor parallelism: give a `layout_map` over a mesh with
    a second axis (`("batch", "model")`, e.g. from
    `kd.layouts.tensor_parallel`) and each variable keeps the model-axis
    layout the map gives it, with `axis` added on one of its other
    dimensions. A layout that already uses `axis` is kept as it is (as
    KerasHub's maps do).

    Args:
        device_mesh: the mesh. Defaults to the layout map's mesh, else a 1-D
            mesh over every device with the axis named `axis`.
        axis: the data axis: the mesh axis batches and variables are split
            along.
        min_size: variables with fewer elements stay replicated: gathering
            a tiny tensor costs more in latency than its memory is worth.
        layout_map: an optional `LayoutMap` for the other mesh axes.
        auto_shard_dataset: see `Distribution`.
        remat: keyword only; see `Distribution` (activation checkpointing, for
            models whose activations do not fit beside their shards).
        mixed_precision: keyword only; see `ModelParallel` (FSDP2's
            `MixedPrecisionPolicy`: weights gathered and computed in bfloat16,
            kept float32 in their shards).
        keep_optimizer_sharded: keyword only, PyTorch. True (the default):
            the optimizer's state (Adam's moments: 8 bytes a parameter in
            fp32) stays split between calls, each process holding its part,
            and the next `fit` under this distribution goes on from it; only
            the weights are gathered when a call ends (FSDP2 keeps both
            split). Reading that state outside a call (`model.save`,
            `save_weights`, `kd.export`, `optimizer.variables[i].numpy()`)
            gathers it back into whole tensors and is collective: every
            process must make the same call, as Keras 3.16 asks for its own
            sharded torch variables; a save on one process only fails within
            `KERAS_DIST_INIT_TIMEOUT` seconds with an error naming this.
            False: the optimizer's state is gathered with the weights when a
            call ends, an ordinary Keras model again (a save on process 0
            alone works then), at the cost of the whole state on every
            process between calls and at each call's end. A `fit` without
            this distribution gathers the state back first. On JAX the state
            is a sharded array either way; TensorFlow does not split it.

    `offload=`, `optimizer_state_dtype=` (keyword only): see `Distribution`.
    `sequence_axis=` (keyword only): see `Distribution`; each large variable
    is split along that axis too, on another of its dimensions, so weights
    and optimizer state are spread over every device of the mesh.

    Example:

    >>> distribution = keras_dist.FSDP(devices=["cpu:0"])
    >>> distribution.axis, distribution.batch_dim_name
    ('batch', 'batch')
    """

    shards_variables_along_batch = True

    def __init__(
        self,
        device_mesh: Any = None,
        axis: str = DEFAULT_BATCH_DIM_NAME,
        min_size: int = 1024,
        layout_map: Any = None,
        auto_shard_dataset: bool = True,
        *,
        devices: Any = None,
        remat: Any = None,
        keep_optimizer_sharded: bool = True,
        mixed_precision: Any = None,
        offload: Any = None,
        optimizer_state_dtype: Any = None,
        sequence_axis: Any = None,
    ):
        if not isinstance(keep_optimizer_sharded, bool):
            raise TypeError(
                "`keep_optimizer_sharded` must be True or False. Received: "
                f"keep_optimizer_sharded={keep_optimizer_sharded!r}"
            )
        if not isinstance(axis, str):
            raise TypeError(
                f"`axis` must be the name of a mesh axis. Received: axis={axis!r}"
            )
        if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)):
            raise TypeError(
                "`min_size` must be an int number of elements. Received: "
                f"min_size={min_size!r}"
            )
        if min_size < 0:
            raise ValueError(
                f"`min_size` must be 0 or more. Received: min_size={min_size}"
            )
        if device_mesh is None and devices is None and layout_map is not None:
            device_mesh = layout_map.device_mesh
        device_mesh = one_axis_mesh(device_mesh, devices, axis, "FSDP")
        if axis not in device_mesh.axis_names:
            raise ValueError(
                f"`axis` must be an axis of the mesh, one of "
                f"{list(device_mesh.axis_names)}. Received: axis={axis!r}"
            )
        if layout_map is None:
            from keras_dist.distribution.layout_map import LayoutMap

            layout_map = LayoutMap(device_mesh)
        self._axis = axis
        self._min_size = int(min_size)
        self._keep_optimizer_sharded = keep_optimizer_sharded
        super().__init__(
            device_mesh,
            layout_map,
            axis,
            auto_shard_dataset,
            remat=remat,
            mixed_precision=mixed_precision,
            offload=offload,
            optimizer_state_dtype=optimizer_state_dtype,
            sequence_axis=sequence_axis,
        )

    @property
    def axis(self) -> str:
        """The mesh axis that splits batches and variables."""
        return self._axis

    @property
    def min_size(self) -> int:
        return self._min_size

    @property
    def keep_optimizer_sharded(self) -> bool:
        """Whether the optimizer's state stays split between calls (PyTorch)."""
        return self._keep_optimizer_sharded

    def fsdp_dimension(
        self, path: str, shape: tuple, dtype: Any, axes: tuple, axis: Any = None
    ) -> int | None:
        """The dimension `axis` (default: `self.axis`) splits for a variable
        with this `path`, `shape`, `dtype` and layout-map `axes`, or None."""
        axis = axis or self._axis
        if axis in axes or "float" not in keras.backend.standardize_dtype(dtype):
            return None
        if int(np.prod(shape, dtype=np.int64)) < self._min_size:
            return None
        mesh = self.device_mesh
        parts = int(mesh.shape[list(mesh.axis_names).index(axis)])
        candidates = [
            dim
            for dim, size in enumerate(shape)
            if axes[dim] is None and size % parts == 0 and size >= parts
        ]
        if parts == 1 or not candidates:
            return None
        return max(candidates, key=lambda dim: (shape[dim], -dim))

    def layout_for_variable(self, variable: Any) -> Any:
        layout = super().layout_for_variable(variable)
        shape = tuple(int(size) for size in variable.shape)
        axes = tuple(layout.axes)
        for axis in filter(None, (self._axis, self.sequence_axis)):
            dimension = self.fsdp_dimension(
                variable.path, shape, variable.dtype, axes, axis
            )
            if dimension is not None:
                axes = axes[:dimension] + (axis,) + axes[dimension + 1 :]
        return TensorLayout(axes, self.device_mesh)

    def __repr__(self) -> str:
        return (
            f"<FSDP device_mesh={self.device_mesh}, axis={self._axis!r}, "
            f"min_size={self._min_size}"
            + (f", sequence_axis={self.sequence_axis!r}" if self.sequence_axis else "")
            + ("" if self._keep_optimizer_sharded else ", keep_optimizer_sharded=False")
            + (
                f", mixed_precision={self.mixed_precision}"
                if self.mixed_precision
                else ""
            )
            + ">"
        )
