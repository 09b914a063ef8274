"""keras_dist meshes and layouts on PyTorch: a torch `DeviceMesh` per mesh, DTensor
placements per layout. Each process drives one device, so a mesh's devices are
the job's ranks."""

from __future__ import annotations

import atexit
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

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

from keras_dist.keras_compat import torch_trainer

_meshes: dict[tuple, TorchDeviceMesh] = {}


def device_type() -> str:
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


_own_group: Any = None


def _is_own_group() -> bool:
    """Whether the default process group is the one-process group
    `_ensure_process_group` made (not a job's)."""
    return (
        _own_group is not None
        and torch_distributed.is_initialized()
        and torch_distributed.group.WORLD is _own_group
    )


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
    global _own_group
    _own_group = torch_distributed.group.WORLD
    # Plain Keras models in this process must not see a job (Keras 3.16 wraps
    # a model in DDP whenever a group exists).
    torch_trainer.keep_keras_from_wrapping_over(_is_own_group)
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
        mesh = TorchDeviceMesh(
            device_type(),
            torch.as_tensor(ranks),
            mesh_dim_names=tuple(device_mesh.axis_names),
        )
        _flatten_axes(mesh)
        _meshes[key] = mesh
    return _meshes[key]


def _flatten_axes(mesh: TorchDeviceMesh) -> None:
    """Give DTensor a flattened mesh (a process group) for every set of two or
    more axes of `mesh` (collective, like the mesh itself).

    A value that is `Partial` along both axes of a ("batch", "model") mesh (a
    matmul whose kernel KerasHub splits along both, `("model", "batch")`) is
    made whole by summing over both. Without a flattened mesh DTensor does that
    in one all-reduce per axis, and warns on every rank ("While redistributing
    from (Partial(sum), Partial(sum)) to (Replicate(), Replicate()), 2
    sequential all_reduce operations will be performed"), even when one axis
    has a single process; with one, it does one all-reduce over both axes'
    processes, which also sums in one order on every rank. The same holds for
    all-gathers and reduce-scatters along several axes. torch before 2.5 has
    neither the flattening nor the warning."""
    names = mesh.mesh_dim_names
    if names is None or not hasattr(mesh, "_flatten"):
        return
    for count in range(2, len(names) + 1):
        for axes in itertools.combinations(names, count):
            mesh[axes]._flatten()


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
