"""The torch process group's world, the group keras_dist's CPU collectives
run on, and its bounded barrier, shared by the adapter and the modules it
imports (`split_state`, `global_moments`), none of which may import the
adapter back.

keras_dist runs some collectives on CPU tensors whatever the model's device:
the metric states' sums (float64 buffers), the batch sizes, the input
fingerprints, process 0's random streams, the bounded barrier. NCCL, the
backend `keras_dist.initialize()` starts where CUDA is available, takes CUDA
tensors only; these collectives then run on a gloo group of the same
processes (`cpu_group`), made once per job, as torch's own distributed
checkpoint does. Where the default group is gloo they run on it.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as torch_distributed

#: The `torch.distributed` backend `keras_dist.initialize()` starts (any string
#: `init_process_group` takes: `nccl`, `gloo`, `cpu:gloo,cuda:nccl`, `mpi`).
BACKEND_VARIABLE = "KERAS_DIST_TORCH_BACKEND"

# id(default group) -> its gloo companion, or None where the default group is
# gloo itself.
_cpu_groups: dict[int, Any] = {}


def world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    if torch_distributed.is_available() and torch_distributed.is_initialized():
        return torch_distributed.get_world_size(), torch_distributed.get_rank()
    return 1, 0


def backend_to_start() -> str:
    """What `keras_dist.initialize()` passes to `init_process_group`:
    `KERAS_DIST_TORCH_BACKEND`, else NCCL where CUDA is available, else gloo."""
    chosen = os.environ.get(BACKEND_VARIABLE, "").strip()
    if chosen:
        return chosen
    return "nccl" if torch.cuda.is_available() else "gloo"


def cpu_group() -> Any:
    """The process group for collectives on CPU tensors: None (the default
    group) when the default group is gloo or the job has one process, else
    a gloo group of the same processes. Making it is a collective: call it
    where every process does, in the same order (`initialize`, a run's
    activation); later calls return the same group."""
    if world()[0] == 1:
        return None
    default = torch_distributed.distributed_c10d._get_default_group()
    if id(default) not in _cpu_groups:
        _cpu_groups.clear()  # a new job (the old default group was destroyed)
        is_gloo = torch_distributed.get_backend() == "gloo"
        _cpu_groups[id(default)] = (
            None if is_gloo else torch_distributed.new_group(backend="gloo")
        )
    return _cpu_groups[id(default)]


def group_for(device: Any) -> Any:
    """The group for a collective on tensors on `device` (a `torch.device`
    or its type): `cpu_group()` for CPU tensors, else None (the default
    group: NCCL for CUDA tensors)."""
    kind = device if isinstance(device, str) else device.type
    return cpu_group() if kind == "cpu" else None


def bounded_barrier(timeout_seconds: float) -> None:
    """Wait for every process at most `timeout_seconds`; raise what torch
    raised when they do not all come (gloo's monitored barrier, on the
    default group or its gloo companion, names the ranks that did not).
    Nothing to wait for in a one-process job."""
    if world()[0] == 1:
        return
    torch_distributed.monitored_barrier(
        group=cpu_group(), timeout=datetime.timedelta(seconds=timeout_seconds)
    )
