"""`ModelParallel` on PyTorch: sharded variables as `torch.distributed.tensor`.

Each process drives one device of the mesh. While a `fit`, `evaluate` or
`predict` runs under a `ModelParallel` whose `LayoutMap` shards variables, every
weight of the model is a DTensor on a torch `DeviceMesh` with the keras_dist
mesh's shape and axis names: a tensor dimension laid out along a mesh axis is
`Shard(dim)` on that axis, anything else `Replicate()`, so each process holds
1/N of a variable sharded N ways. The optimizer's slots (Adam's moments, SGD's
momentum...) get the placements of the variable they mirror; its scalars (the
iteration count, the learning rate) stay plain tensors. The values come from
process 0, as `DistributedDataParallel` does for replicas.

Every process reads the whole global batch. With a batch axis of size N > 1
the model's inputs become DTensors split into N row blocks along that axis
(each process keeps its block, no communication; uneven blocks are fine, so
there is no padding), so the compute is split as in data parallelism; with a
batch axis of size 1 they act as replicated (`implicit_replication`, which also
lets plain tensors inside layers mix with DTensors). torch's DTensor dispatch
inserts the collectives that the sharded ops need, including the reduction of
the gradients of variables replicated along the batch axis. The model's outputs
are gathered into plain full tensors before the loss and the metrics, so losses,
metrics and predictions are computed alike, and are global, on every process.

When the call ends the variables are gathered back into plain, full tensors: the
model is then an ordinary Keras model again (`model(x)`, `get_weights()`,
`save_weights()`, a later call without a distribution all work as usual), and
the next distributed call shards it again. While a call runs, `np.asarray` of a
sharded variable (`get_weights()`, checkpoints in callbacks) gathers its full
value, which is collective: every process must do it, as keras_dist's
callbacks do.

An op that DTensor cannot run (e.g. a sharded `Conv2D` kernel in this torch
release) fails with a `NotImplementedError` that names the op and the layer.

Pure FSDP (variables split along the batch axis only) skips DTensor's per-op
dispatch inside the model, as FSDP2 does: each layer computes on this
process' rows and its whole weights as plain tensors, gathered in one
collective per layer call, and the model's outputs are gathered into the
whole batch's (`fsdp_compute`, "plain compute" in `ShardedRun`). The
variables, the optimizer's slots and what callbacks see are the same
DTensors either way.
"""

from __future__ import annotations

import atexit
import contextlib
import linecache
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as torch_distributed
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication

from keras_dist._keras_compat import layers_of, slot_owners
from keras_dist.backends.torch import keras_internals as internals
from keras_dist.backends.torch.fsdp_compute import (
    BatchGroup,
    ReshardAfterForward,
    chunk_bounds,
    gather_layer_variables,
    gather_rows,
    sum_over_processes,
)

_meshes: dict[tuple, TorchDeviceMesh] = {}
# Keras optimizers that update each element of a variable from the same
# element of its gradient and slots (see `ShardedRun._updates_elementwise`).
_ELEMENTWISE_OPTIMIZERS = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Nadam",
        "Lion",
        "Ftrl",
    }
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _world_size() -> int:
    if torch_distributed.is_available() and torch_distributed.is_initialized():
        return torch_distributed.get_world_size()
    return 1


def mesh_ranks(device_mesh: Any, world_size: int) -> np.ndarray:
    """The process rank of every device of a keras_dist mesh, shaped like it.

    On PyTorch each process drives one device, and `keras_dist.list_devices()`
    names process `r`'s device `"cpu:r"` (or `"gpu:r"`), so the device index is
    the rank. The mesh must hold every process' device once.
    """
    shape = tuple(int(size) for size in device_mesh.shape)
    names = [str(device) for device in np.asarray(device_mesh.devices).reshape(-1)]
    if math.prod(shape) != world_size:
        raise ValueError(
            "On PyTorch each process drives one device, so the device mesh must "
            f"have one device per process: a mesh of shape {shape} "
            f"({math.prod(shape)} devices) needs {math.prod(shape)} processes, "
            f"but this job has {world_size}. Build the mesh from "
            "`keras_dist.list_devices()` or start that many processes "
            f"(`keras-dist launch --nproc-per-node {math.prod(shape)}`). "
            f"Received: devices={names}"
        )
    ranks = []
    for name in names:
        match = re.fullmatch(r"[a-z]+:(\d+)", name)
        if match is None:
            raise ValueError(
                "On PyTorch, mesh devices are named like 'cpu:0' or 'gpu:1', one "
                f"per process (`keras_dist.list_devices()`). Received: {name!r} in "
                f"devices={names}"
            )
        ranks.append(int(match.group(1)))
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(
            "On PyTorch the mesh must hold the device of every process once, "
            f"{[f'cpu:{rank}' for rank in range(world_size)]} for {world_size} "
            f"processes on CPU. Received: devices={names}"
        )
    return np.asarray(ranks, dtype=np.int64).reshape(shape)


def _ensure_process_group() -> None:
    """A one-process job gets a one-process group (an in-memory store, no
    port), which torch's DeviceMesh needs; a multi-process job must have
    called `keras_dist.initialize()` already."""
    if torch_distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch_distributed.init_process_group(
        backend, store=torch_distributed.HashStore(), rank=0, world_size=1
    )
    # As after `keras_dist.initialize()`: gloo may abort the interpreter at
    # exit without this.
    atexit.register(torch_distributed.destroy_process_group)


def torch_mesh(device_mesh: Any) -> TorchDeviceMesh:
    """The torch `DeviceMesh` of a keras_dist mesh (built once; collective)."""
    _ensure_process_group()
    world_size = _world_size()
    ranks = mesh_ranks(device_mesh, world_size)
    key = (ranks.shape, tuple(device_mesh.axis_names), tuple(ranks.reshape(-1)))
    if key not in _meshes:
        _meshes[key] = TorchDeviceMesh(
            _device_type(),
            torch.as_tensor(ranks),
            mesh_dim_names=tuple(device_mesh.axis_names),
        )
    return _meshes[key]


def placements(axes: Sequence[str | None], axis_names: Sequence[str]) -> tuple:
    """DTensor placements of a layout: one per mesh axis, in mesh order.

    A mesh axis that shards tensor dimension `d` (`axes[d]` names it) is
    `Shard(d)`; a mesh axis no dimension names is `Replicate()`.
    """
    axes = tuple(axes)
    unknown = [axis for axis in axes if axis is not None and axis not in axis_names]
    if unknown:
        raise ValueError(
            f"Layout axes {unknown} are not axes of the mesh {list(axis_names)}. "
            f"Received: axes={axes}"
        )
    return tuple(
        Shard(axes.index(name)) if name in axes else Replicate() for name in axis_names
    )


def distribute(
    tensor: Any, mesh: TorchDeviceMesh, layout: tuple, device: torch.device
) -> DTensor:
    """`tensor` as a DTensor with placements `layout` on `mesh`.

    A DTensor is redistributed; anything else is converted to a tensor and
    taken from process 0, as torch's `distribute_tensor` does.
    """
    if isinstance(tensor, DTensor):
        return tensor.redistribute(mesh, layout)
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(np.asarray(tensor))
    return distribute_tensor(tensor.to(device), mesh, layout)


def is_placements(layout: Any) -> bool:
    """Whether `layout` is a sequence of DTensor placements (`Shard(0)`,
    `Replicate()`...), what `TensorLayout.backend_layout` is on PyTorch."""
    return (
        isinstance(layout, (tuple, list))
        and len(layout) > 0
        and all(isinstance(placement, Placement) for placement in layout)
    )


def redistribute(tensor: Any, layout: Sequence[Placement]) -> DTensor:
    """A DTensor `tensor` with placements `layout` on its own mesh."""
    if not isinstance(tensor, DTensor):
        raise ValueError(
            "DTensor placements carry no device mesh, so they can only lay out "
            "a DTensor (on its own mesh). For any other tensor pass a "
            "TensorLayout with a device mesh. Received: a tensor of type "
            f"{type(tensor).__name__} and layout={tuple(layout)}"
        )
    return tensor.redistribute(tensor.device_mesh, tuple(layout))


def to_full(value: Any) -> Any:
    """A plain tensor with the whole value of `value` (gathered if a DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _mesh_size(device_mesh: Any, axis: str) -> int:
    return int(device_mesh.shape[list(device_mesh.axis_names).index(axis)])


def is_sharded(layout: Any) -> bool:
    """Whether `layout` splits a variable (names a mesh axis of size > 1)."""
    return any(
        axis is not None and _mesh_size(layout.device_mesh, axis) > 1
        for axis in layout.axes
    )


def check_batch_axis(distribution: Any) -> None:
    """Refuse what the DTensor path does not do: per-process data."""
    if not distribution.auto_shard_dataset:
        raise ValueError(
            "With sharded variables on PyTorch every process must read the same "
            "global batches (each keeps its rows along the batch axis), so "
            "`auto_shard_dataset=False` (each process reads its own data) cannot "
            "be used. Received: auto_shard_dataset=False with a batch axis "
            f"{distribution.batch_dim_name!r} of size "
            f"{distribution.num_model_replicas}"
        )


# -- while a run is active, variables read and assign like plain ones ----------
# `np.asarray(variable)` (get_weights, checkpoints) gathers a DTensor, and
# assigning a plain value (set_weights, load_weights, EarlyStopping's restore)
# keeps this process' part of it. One set of patches for all active runs.
_variable_patches: list[Callable[[], None]] = []


def _as_placed(current: Any, value: Any) -> Any:
    """`value` laid out like `current` when that is a DTensor: every process
    holds the whole value, so each keeps its part (no communication).

    The part is cut where the value is (a NumPy value from `load_weights`, a
    checkpoint read whole: on the host) and only the part moves to this
    process' device, never the whole value (keras#21712)."""
    if not isinstance(current, DTensor) or isinstance(value, DTensor):
        return value
    if tuple(np.shape(value)) != tuple(current.shape):
        return value  # Keras names the wrong shape
    local_shape, offset = compute_local_shape_and_global_offset(
        current.shape, current.device_mesh, current.placements
    )
    index = tuple(
        slice(start, start + size)
        for start, size in zip(offset, local_shape, strict=True)
    )
    local = current.to_local()
    if isinstance(value, np.ndarray):
        # Keras' conversion: NumPy's bfloat16 and uint32, which torch lacks.
        part = keras.ops.convert_to_tensor(value[index])
    else:
        part = torch.as_tensor(value)[index]
    part = part.to(device=local.device, dtype=local.dtype).contiguous()
    return DTensor.from_local(
        part,
        current.device_mesh,
        current.placements,
        run_check=False,
        shape=current.shape,
        stride=current.stride(),
    )


# The plain-compute runs (see `ShardedRun`) whose model is being called,
# innermost last: a variable read then gathers its whole value.
_reading: list[ShardedRun] = []


def _read_variable(variable: Any, value: Any) -> Any:
    if _reading and isinstance(value, DTensor):
        return _reading[-1].gather_on_read(variable, value)
    return value


def _patch_variables() -> None:
    if not _variable_patches:
        undo_read = internals.convert_variables_to_numpy_via(to_full)
        undo_write = internals.assign_variables_via(_as_placed)
        undo_value = internals.read_variables_via(_read_variable)

        def undo() -> None:
            undo_value()
            undo_write()
            undo_read()

        _variable_patches.append(undo)
    else:
        _variable_patches.append(_variable_patches[-1])


def _unpatch_variables() -> None:
    if _variable_patches:
        undo = _variable_patches.pop()
        if not _variable_patches:
            undo()


# -- failures ------------------------------------------------------------------
def _frames(error: BaseException) -> list[Any]:
    frames = []
    traceback = error.__traceback__
    while traceback is not None:
        frames.append(traceback)
        traceback = traceback.tb_next
    return frames


def _failed_op(error: BaseException) -> str | None:
    """The op that raised `error`, innermost first: the aten op DTensor was
    dispatching, else the torch call in Keras' torch backend, else one that the
    message names."""
    frames = _frames(error)
    for traceback in reversed(frames):
        op = traceback.tb_frame.f_locals.get("op_call")
        if isinstance(op, torch._ops.OpOverload):
            return str(op)
    for traceback in reversed(frames):
        code = traceback.tb_frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if "keras/src/backend/torch/" in filename:
            module = traceback.tb_frame.f_globals.get("__name__", "")
            line = linecache.getline(code.co_filename, traceback.tb_lineno).strip()
            return f"`{line}` ({module}.{code.co_name})"
    match = re.search(r"\baten\.[\w.]+", str(error))
    return match.group(0).rstrip(".") if match else None


def _from_dtensor(error: BaseException) -> bool:
    for traceback in _frames(error):
        filename = traceback.tb_frame.f_code.co_filename.replace("\\", "/")
        if "torch/distributed/tensor/" in filename:
            return True
    return "DTensor" in str(error) or "sharding strateg" in str(error)


def _attention_kernels() -> contextlib.AbstractContextManager:
    """On CPU, `scaled_dot_product_attention` through its math kernel: DTensor
    (torch 2.13) has no sharding rule for the backward of the CPU
    flash-attention kernel torch picks otherwise (Keras' MultiHeadAttention,
    KerasHub's attention), and the math kernel is made of ops it shards. The
    result is the same attention, up to float rounding."""
    if _device_type() != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


class ShardedRun:
    """One model's variables sharded as DTensors, from `start()` to `stop()`.

    Two ways of computing, chosen in `start()`:

    - DTensor compute (any layout): the model's inputs are DTensors split
      along the batch axis and every op goes through DTensor's dispatch,
      which inserts the collectives the layouts need. Each layer's
      batch-split trainable variables are gathered while it runs.
    - Plain compute (pure FSDP: no variable is split along another mesh axis
      of size > 1; no BatchNormalization; see `_plain_compute_group`): what
      FSDP2 does. Each process computes on its rows of every batch as plain
      tensors, each layer call gathers the whole values of its own variables
      in one all-gather (`fsdp_compute`), whose backward reduce-scatters the
      gradients onto their owners; the whole values are freed when the
      layer's forward ends and gathered again in its backward (inside the
      steps: `_step`); the model's outputs are gathered into the whole
      batch's. A variable read inside the model outside its own layer
      (a tied weight), or while the loss is computed (a weight regularizer),
      is gathered the same way. No DTensor op runs inside the model, so an
      op there that mixes rows sees this process' rows only, as under
      DataParallel (losses that layers add are averaged over processes,
      `_average_added_losses`). Between steps and in the optimizer update the
      variables are DTensors as in DTensor compute; an optimizer that updates
      every element on its own (Adam, SGD...: `_updates_elementwise`) updates
      each process' parts as plain tensors.

    Args:
        model: the Keras model.
        distribution: the `ModelParallel` whose layouts shard it.
    """

    def __init__(self, model: Any, distribution: Any):
        self.model = model
        self.distribution = distribution
        self.mesh = torch_mesh(distribution.device_mesh)
        self._variables: list[Any] = []  # every variable made a DTensor
        # id(variable) -> its DTensor Parameter (what it holds between layers).
        self._values: dict[int, Any] = {}
        self._hooks: list[Any] = []
        self._layers: list[Any] = []  # the layers being called, innermost last
        self._depth = 0
        # Variables split along the batch axis, gathered while their layer runs:
        # id -> (variable, its sharded Parameter, how many calls hold it).
        self._gathered: dict[int, list[Any]] = {}
        # Plain compute (see the class): the processes along the batch axis,
        # None for DTensor compute.
        self._batch: BatchGroup | None = None
        self._local_update = False
        # Plain compute: id(layer) -> [its gathered variables, how many calls
        # hold them, the gathered values' versions (to see writes)].
        self._layer_gathers: dict[int, list[Any]] = {}
        # Plain compute: whole values of variables read outside their own
        # layer's call, for one model call: id(variable) -> [variable, whole
        # value, its version].
        self._read_cache: dict[int, list[Any]] = {}
        # Plain compute: frees those whole values when their layer's forward
        # ends and gathers them again in its backward.
        self._reshard = ReshardAfterForward()
        self._rows: list[int] = []  # rows of the whole batch, per model call
        self._all_layers: list[Any] = []  # the model and every layer in it
        # Plain compute, elementwise optimizer: id(variable) -> a Parameter
        # sharing its DTensor's local storage, for the optimizer's update.
        self._locals: dict[int, torch.nn.Parameter] = {}

    # -- variables -------------------------------------------------------------
    def _planned(self) -> list[tuple[Any, Any]]:
        """Every variable that becomes a DTensor, with its layout's axes."""
        model, distribution = self.model, self.distribution
        planned: dict[int, tuple[Any, Any]] = {}
        for variable in model.weights:
            layout = distribution.layout_for_variable(variable)
            planned.setdefault(id(variable), (variable, layout.axes))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and model.trainable_weights and not optimizer.built:
            optimizer.build(model.trainable_weights)
        if optimizer is not None and optimizer.built:
            owners = slot_owners(optimizer, model.trainable_weights)
            for slot in optimizer.variables:
                owner = owners.get(id(slot))
                if owner is not None and id(owner) in planned:
                    planned.setdefault(id(slot), (slot, planned[id(owner)][1]))
        return list(planned.values())

    def _plain_optimizer_variables(self) -> list[Any]:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return []
        sharded = {id(variable) for variable in self._variables}
        return [v for v in optimizer.variables if id(v) not in sharded]

    def start(self) -> ShardedRun:
        axis_names = list(self.distribution.device_mesh.axis_names)
        with torch.no_grad():
            for variable, axes in self._planned():
                value = internals.variable_storage(variable)
                sharded = distribute_tensor(
                    value.detach(), self.mesh, placements(axes, axis_names)
                )
                parameter = torch.nn.Parameter(
                    sharded, requires_grad=value.requires_grad
                )
                internals.set_variable_storage(variable, parameter)
                self._variables.append(variable)
                self._values[id(variable)] = parameter
            # The optimizer's scalars (iterations...) start as process 0's too.
            for variable in self._plain_optimizer_variables():
                value = variable.value.detach().clone()
                torch_distributed.broadcast(value, src=0)
                variable.assign(value)
        internals.retrack_parameters(self.model)
        self._all_layers = layers_of(self.model)
        self._batch = self._plain_compute_group()
        self._local_update = self._batch is not None and self._updates_elementwise()
        self._track_layers()
        _patch_variables()
        return self

    def stop(self) -> None:
        """Gather every variable back into a plain, full tensor (collective)."""
        _unpatch_variables()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with torch.no_grad():
            for variable in self._variables:
                value = internals.variable_storage(variable)
                if isinstance(value, DTensor):
                    internals.set_variable_storage(
                        variable,
                        torch.nn.Parameter(
                            value.full_tensor(), requires_grad=value.requires_grad
                        ),
                    )
        self._variables.clear()
        self._values.clear()
        self._locals.clear()
        internals.retrack_parameters(self.model)

    def relayout(self, tensor: Any, layout: Any) -> Any:
        """A layer output laid out as the `LayoutMap` says (`"<layer>/output"`
        entries): a DTensor is redistributed, autograd included; a plain tensor
        (full on every process) is left as it is."""
        if not isinstance(tensor, DTensor):
            return tensor
        names = list(self.distribution.device_mesh.axis_names)
        return tensor.redistribute(self.mesh, placements(layout.axes, names))

    # -- layers, outputs and failures ------------------------------------------
    def _track_layers(self) -> None:
        batch_placements = None
        if self.distribution.num_model_replicas > 1:
            # The batch rows are split along the batch axis: each process
            # computes on its share of every global batch.
            batch_placements = tuple(
                Shard(0) if name == self.distribution.batch_dim_name else Replicate()
                for name in self.distribution.device_mesh.axis_names
            )

        def split_rows(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                return value
            if value.ndim == 0:
                return value
            # Every process holds the whole batch: each keeps its rows, no
            # communication (`src_data_rank=None`); uneven splits are fine.
            return distribute_tensor(
                value, self.mesh, batch_placements, src_data_rank=None
            )

        def enter(layer: Any, args: Any) -> Any:
            self._layers.append(layer)
            self._gather_own_variables(layer)
            if layer is self.model and batch_placements is not None:
                return keras.tree.map_structure(split_rows, args)
            return None

        def leave(layer: Any, args: Any, outputs: Any) -> Any:
            if self._layers and self._layers[-1] is layer:
                self._layers.pop()
            self._release_own_variables(layer)
            if layer is self.model:
                # Losses, metrics and predictions see plain, full tensors.
                return keras.tree.map_structure(to_full, outputs)
            return None

        if self._batch is not None:
            enter, leave = self._enter_plain, self._leave_plain
        for layer in self._all_layers:
            self._hooks.append(layer.register_forward_pre_hook(enter))
            self._hooks.append(layer.register_forward_hook(leave))

    # -- plain compute (pure FSDP) ----------------------------------------------
    def _plain_compute_group(self) -> BatchGroup | None:
        """The processes along the batch axis when plain compute applies (see
        the class), else None.

        Not with a variable split along another mesh axis of size > 1 (that
        needs DTensor's ops); not with a BatchNormalization layer, whose
        statistics span the rows of every process (DTensor compute reduces
        them, plain compute would not); not with a split variable that a layer
        created non-trainable: such statistics are assigned while the layer
        runs, from every process' rows, and a layer in plain compute writes
        to a whole copy (`_check_not_written`)."""
        index = self._batch_axis_index()
        if index is None:
            return None
        sizes = self.mesh.shape
        for value in self._values.values():
            for axis, placement in enumerate(value.placements):
                if axis != index and sizes[axis] > 1 and not placement.is_replicate():
                    return None
        layers = self._all_layers
        if any(isinstance(layer, keras.layers.BatchNormalization) for layer in layers):
            return None
        for layer in layers:
            for variable in internals.own_non_trainable_variables(layer):
                value = self._values.get(id(variable))
                if value is not None and not all(
                    placement.is_replicate() for placement in value.placements
                ):
                    return None
        name = self.distribution.batch_dim_name
        return BatchGroup(
            group=self.mesh.get_group(name),
            size=int(sizes[index]),
            index=int(self.mesh.get_local_rank(name)),
        )

    def _enter_plain(self, layer: Any, args: Any) -> Any:
        self._layers.append(layer)
        split = None
        if layer is self.model:
            # This process' rows of every input, as plain tensors (no
            # communication: every process holds the whole batch).
            batch = self._batch
            rows = [
                int(value.shape[0])
                for value in keras.tree.flatten(args)
                if isinstance(value, torch.Tensor) and value.ndim > 0
            ]
            self._rows.append(rows[0] if rows else 0)

            def own_rows(value: Any) -> Any:
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    return value
                value = to_full(value)
                start, length = chunk_bounds(value.shape[0], batch.size, batch.index)
                return value.narrow(0, start, length)

            split = keras.tree.map_structure(own_rows, args)
            _reading.append(self)
        self._gather_layer(layer)
        return split

    def _leave_plain(self, layer: Any, args: Any, outputs: Any) -> Any:
        if self._layers and self._layers[-1] is layer:
            self._layers.pop()
        self._release_layer(layer)
        if layer is not self.model:
            return None
        self._end_reads()
        total = self._rows.pop() if self._rows else 0
        self._average_added_losses(total)
        batch = self._batch
        own = chunk_bounds(total, batch.size, batch.index)[1]

        def whole_rows(value: Any) -> Any:
            # An output with this process' rows: every process' rows, in order.
            # Anything else was computed from whole tensors and is the same on
            # every process.
            if isinstance(value, DTensor):
                return to_full(value)
            if (
                isinstance(value, torch.Tensor)
                and value.ndim > 0
                and value.shape[0] == own
            ):
                return gather_rows(batch, total, value)
            return value

        return keras.tree.map_structure(whole_rows, outputs)

    def _gather_layer(self, layer: Any) -> None:
        """The whole values of the layer's own DTensor variables, in one
        collective, held by the variables while the layer runs."""
        held = self._layer_gathers.get(id(layer))
        if held is not None:
            held[1] += 1
            return
        variables = [
            variable
            for variable in internals.own_variables(layer)
            if isinstance(internals.variable_storage(variable), DTensor)
        ]
        if not variables:
            return
        whole, regathers = gather_layer_variables(
            self._batch,
            self.mesh,
            self._batch_axis_index(),
            [internals.variable_storage(variable) for variable in variables],
        )
        self._reshard.hold(whole, regathers)
        for variable, value in zip(variables, whole, strict=True):
            internals.set_variable_storage(variable, value)
        self._layer_gathers[id(layer)] = [
            variables,
            1,
            [value._version for value in whole],
        ]

    def _release_layer(self, layer: Any) -> None:
        held = self._layer_gathers.get(id(layer))
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del self._layer_gathers[id(layer)]
        variables, _, versions = held
        gathered = []
        for variable, version in zip(variables, versions, strict=True):
            gathered.append([variable, internals.variable_storage(variable), version])
            internals.set_variable_storage(variable, self._values[id(variable)])
        self._reshard.release([whole for _, whole, _ in gathered])
        self._check_not_written(layer, gathered)

    def _check_not_written(self, layer: Any, gathered: list[list[Any]]) -> None:
        """Refuse an assignment to a gathered whole value of a split variable
        ([variable, whole value, its version when gathered]): it would be
        lost, only the variable's parts are kept."""
        written = [
            variable.path
            for variable, whole, version in gathered
            if whole._version != version
            and any(not p.is_replicate() for p in self._values[id(variable)].placements)
        ]
        if written:
            raise NotImplementedError(
                f"Variables {written} were assigned while layer "
                f"{getattr(layer, 'path', None) or layer.name!r} "
                f"({type(layer).__name__}) ran. FSDP on PyTorch gives a layer the "
                "whole values of variables split along the batch axis for its "
                "call and does not write them back. Keep such variables whole: "
                "raise `min_size` above their size or lay them out replicated "
                "in the LayoutMap."
            )

    def gather_on_read(self, variable: Any, value: DTensor) -> Any:
        """The whole value of a variable read, inside the model's call, outside
        its own layer's call (a weight tied to another layer's): gathered once
        per model call, its gradient reduce-scattered like a layer's."""
        held = self._read_cache.get(id(variable))
        if held is None:
            (whole,), regathers = gather_layer_variables(
                self._batch, self.mesh, self._batch_axis_index(), [value]
            )
            self._reshard.hold([whole], regathers)
            held = self._read_cache[id(variable)] = [variable, whole, whole._version]
        return held[1]

    @contextlib.contextmanager
    def loss_scope(self) -> Iterator[None]:
        """Around the loss computation of keras_dist's steps: in plain compute,
        a variable read (a weight regularizer) gets its whole value, as inside
        the model, so that the loss is a plain tensor; its gradient comes back
        through `fsdp_compute`'s reduce-scatter."""
        if self._batch is None:
            yield
            return
        _reading.append(self)
        try:
            yield
        finally:
            self._end_reads()

    def _end_reads(self) -> None:
        """Stop gathering variables read outside their layer: free the whole
        values read (their backward gathers them again) and check that none
        was written."""
        if _reading and _reading[-1] is self:
            _reading.pop()
        read = list(self._read_cache.values())
        self._read_cache.clear()
        self._reshard.release([whole for _, whole, _ in read])
        self._check_not_written(self.model, read)

    def _average_added_losses(self, total: int) -> None:
        """Losses that layers added (`add_loss`, activity regularizers) from
        this process' rows: replaced by their average over processes, weighted
        by rows, the same on every process (a loss that is a mean over rows is
        then the whole batch's, as on one device). Differentiable: see
        `fsdp_compute` for the gradient's arithmetic."""
        added = [
            (losses, index, loss)
            for layer in self._all_layers
            for losses in (internals.added_losses(layer),)
            for index, loss in enumerate(losses)
        ]
        if not added:
            return
        batch = self._batch
        own = chunk_bounds(total, batch.size, batch.index)[1]
        weight = own / total if total else 1.0 / batch.size
        flat = torch.cat([loss.reshape(-1) for _, _, loss in added])
        summed = sum_over_processes(batch, flat * weight)
        offset = 0
        for losses, index, loss in added:
            losses[index] = summed[offset : offset + loss.numel()].reshape(loss.shape)
            offset += loss.numel()

    def _updates_elementwise(self) -> bool:
        """Whether the model's optimizer updates each element of a variable
        from the same element of its gradient and slots only, so that each
        process can update its parts as plain tensors: Keras' own optimizers
        that do (not a subclass, which may do more), without clipping by a
        norm, and with no optimizer variable but scalars outside the run."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return False
        kind = type(optimizer)
        if (
            kind.__name__ not in _ELEMENTWISE_OPTIMIZERS
            or not kind.__module__.startswith("keras.")
            or getattr(optimizer, "clipnorm", None) is not None
            or getattr(optimizer, "global_clipnorm", None) is not None
        ):
            return False
        return all(
            id(variable) in self._values or len(variable.shape) == 0
            for variable in optimizer.variables
        )

    @contextlib.contextmanager
    def optimizer_update(self) -> Iterator[None]:
        """The optimizer's update (under `no_grad`). With an elementwise
        optimizer in plain compute, every DTensor variable and slot holds its
        local part as a plain Parameter, its gradient's local part as `.grad`:
        Keras' foreach ops then run on plain tensors, in place on the
        DTensors' own storage."""
        with torch.no_grad():
            if not self._local_update:
                yield
                return
            try:
                for variable in self._variables:
                    value = self._values[id(variable)]
                    local = self._locals.get(id(variable))
                    if local is None:
                        # Shares the DTensor's local storage; made once per run.
                        local = torch.nn.Parameter(
                            value.to_local(), requires_grad=value.requires_grad
                        )
                        self._locals[id(variable)] = local
                    grad = value.grad
                    if grad is not None and tuple(grad.placements) != tuple(
                        value.placements
                    ):
                        grad = grad.redistribute(self.mesh, value.placements)
                    local.grad = None if grad is None else grad.to_local()
                    internals.set_variable_storage(variable, local)
                yield
            finally:
                for variable in self._variables:
                    internals.set_variable_storage(variable, self._values[id(variable)])
                for local in self._locals.values():
                    local.grad = None  # the DTensor keeps its gradient

    # -- FSDP: whole weights while their layer runs -----------------------------
    def _batch_axis_index(self) -> int | None:
        if self.distribution.num_model_replicas <= 1:
            return None
        names = list(self.distribution.device_mesh.axis_names)
        return names.index(self.distribution.batch_dim_name)

    def _gather_own_variables(self, layer: Any) -> None:
        """Gather the layer's trainable variables that are split along the batch
        axis (FSDP) before its call, so its ops see whole weights (still split
        along any model axis) and batch rows split along the same axis: no
        collective inside the op. The gather is part of autograd: its backward
        reduce-scatters each gradient onto this process' part, as FSDP does.
        Without this, DTensor picks per-op strategies for rows and weights split
        along one axis, which cost more communication."""
        index = self._batch_axis_index()
        if index is None:
            return
        for variable in internals.own_trainable_variables(layer):
            held = self._gathered.get(id(variable))
            if held is not None:
                held[2] += 1
                continue
            value = internals.variable_storage(variable)
            if not isinstance(value, DTensor) or not isinstance(
                value.placements[index], Shard
            ):
                continue
            whole = list(value.placements)
            whole[index] = Replicate()
            gathered = value.redistribute(self.mesh, tuple(whole))
            self._gathered[id(variable)] = [variable, value, 1]
            internals.set_variable_storage(variable, gathered)

    def _release_own_variables(self, layer: Any) -> None:
        for variable in internals.own_trainable_variables(layer):
            held = self._gathered.get(id(variable))
            if held is None:
                continue
            held[2] -= 1
            if held[2] == 0:
                internals.set_variable_storage(variable, held[1])
                del self._gathered[id(variable)]

    def _release_all_variables(self) -> None:
        """After a step, every variable holds its own part again (a layer that
        raised never reached its forward hook)."""
        for variable, sharded, _ in self._gathered.values():
            internals.set_variable_storage(variable, sharded)
        self._gathered.clear()
        for variables, _, _ in self._layer_gathers.values():
            for variable in variables:
                internals.set_variable_storage(variable, self._values[id(variable)])
        self._layer_gathers.clear()
        self._read_cache.clear()
        self._reshard.clear()
        self._rows.clear()
        while self in _reading:
            _reading.remove(self)

    def _sharded_layouts(self) -> dict[str, tuple]:
        return {
            variable.path: tuple(self._values[id(variable)].placements)
            for variable in self._variables
            if any(not p.is_replicate() for p in self._values[id(variable)].placements)
        }

    def _in_sharded_layer(self) -> bool:
        """Whether the innermost layer being called holds a sharded variable
        (not an outer one: the model holds them all)."""
        if not self._layers:
            return False
        sharded = {
            id(v)
            for v in self._variables
            if any(not p.is_replicate() for p in self._values[id(v)].placements)
        }
        return any(id(variable) in sharded for variable in self._layers[-1].weights)

    def _failure(self, error: BaseException) -> NotImplementedError:
        op = _failed_op(error) or "an op"
        if self._layers:
            layer = self._layers[-1]
            where = (
                f"layer {getattr(layer, 'path', None) or layer.name!r} "
                f"({type(layer).__name__})"
            )
        else:
            where = "the loss, the backward pass or the optimizer update (no layer)"
        lines = _ANSI.sub("", str(error)).strip().splitlines()
        detail = " ".join(line.strip() for line in lines if line.strip())
        return NotImplementedError(
            f"PyTorch's DTensor could not run {op} in {where} with the sharded "
            f"variables of this ModelParallel layout. {type(error).__name__}: "
            f"{detail} -- Replicate that layer's variables (leave them out of the "
            "LayoutMap) or shard them along another dimension. Sharded variables: "
            f"{self._sharded_layouts()}"
        )

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        outermost = self._depth == 0
        self._depth += 1
        if not outermost:
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._layers.clear()
        # Keras' frames stay in tracebacks, so a failure can name the op.
        filtering = keras.config.is_traceback_filtering_enabled()
        if filtering:
            keras.config.disable_traceback_filtering()
        try:
            # Plain compute: a layer's whole weights are freed after its
            # forward, gathered again in its backward (see `Regather`).
            resharding = (
                self._reshard.hooks()
                if self._batch is not None
                else contextlib.nullcontext()
            )
            with implicit_replication(), _attention_kernels(), resharding:
                yield
        except NotImplementedError:
            raise
        except Exception as error:
            # Plain compute runs no DTensor op inside a layer: only an error
            # from DTensor itself is DTensor's.
            in_dtensor_layer = self._batch is None and self._in_sharded_layer()
            if not (_from_dtensor(error) or in_dtensor_layer):
                raise
            raise self._failure(error) from error
        finally:
            self._depth -= 1
            self._release_all_variables()
            if filtering:
                keras.config.enable_traceback_filtering()

    def wrap_steps(self, steps: dict[str, Callable]) -> dict[str, Callable]:
        """The step functions, each run with plain tensors acting as replicated
        DTensors and DTensor failures reported by op and layer."""

        def wrap(step: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:
                with self._step():
                    return step(*args, **kwargs)

            return run

        return {name: wrap(step) for name, step in steps.items()}


def collectives(run: ShardedRun) -> internals.Collectives:
    """The steps' collectives: none are needed, every process sees the whole
    batch and DTensor (or `fsdp_compute`) brings its own."""

    def start_sum(tensor: Any) -> Callable[[], None]:
        return lambda: None

    return internals.Collectives(
        world_size=1,
        start_sum=start_sum,
        gather_from_processes=lambda tensor: tensor,
        # DTensor's gradients are already those of the whole batch.
        average_gradients=lambda gradients: gradients,
        forward=run.model,
        no_grad=run.optimizer_update,
        loss_scope=run.loss_scope,
    )
