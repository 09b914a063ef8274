"""The torch process group's world, the group keras_dist's CPU collectives
run on, how its train step averages the gradients, and its bounded barrier,
shared by the adapter and the modules it imports (`split_state`,
`global_moments`), none of which may import the adapter back.

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

# [the default group, its gloo companion (None where the default group is
# gloo itself)]: held, so a later job's group is never taken for this one's.
_cpu_group: list[Any] = [None, None]


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
    if not torch.cuda.is_available():
        return "gloo"
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") at the
    # first collective: said here, before the job starts.
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    gpus = torch.cuda.device_count()
    if local.isdigit() and int(local) > gpus:
        raise ValueError(
            f"{local} processes on this host (LOCAL_WORLD_SIZE={local}) share "
            f"{gpus} GPU(s), and NCCL, the process group keras_dist starts where "
            "CUDA is available, refuses two processes on one GPU. Start one "
            f"process per GPU (`--nproc-per-node {gpus}`), or set "
            f"{BACKEND_VARIABLE}=gloo to share the GPUs over gloo (slower; for "
            "tests)."
        )
    return "nccl"


def cpu_group(timeout: datetime.timedelta | None = None) -> Any:
    """The process group for collectives on CPU tensors: None (the default
    group) when the default group is gloo or the job has one process, else
    a gloo group of the same processes, whose collectives wait `timeout`
    (torch's default without one). Making it is a collective: call it where
    every process does, in the same order (`initialize`, a run's
    activation); later calls return the same group."""
    if world()[0] == 1:
        return None
    default = torch_distributed.distributed_c10d._get_default_group()
    if _cpu_group[0] is not default:
        is_gloo = torch_distributed.get_backend() == "gloo"
        options = {} if timeout is None else {"timeout": timeout}
        _cpu_group[:] = [
            default,
            None if is_gloo else torch_distributed.new_group(backend="gloo", **options),
        ]
    return _cpu_group[1]


def group_for(device: Any) -> Any:
    """The group for a collective on tensors on `device` (a `torch.device`
    or its type): `cpu_group()` for CPU tensors, else None (the default
    group: NCCL for CUDA tensors)."""
    kind = device if isinstance(device, str) else device.type
    return cpu_group() if kind == "cpu" else None


#: How keras_dist's own train step averages the gradients over the processes.
GRADIENT_SYNC_VARIABLE = "KERAS_DIST_TORCH_GRADIENT_SYNC"
GRADIENT_SYNCS = ("ddp", "after_backward")


def gradient_sync(device: torch.device) -> str:
    """`KERAS_DIST_TORCH_GRADIENT_SYNC`, else what suits `device`:

    - `ddp`: DistributedDataParallel's bucketed all-reduces, started during
      the backward pass (on CUDA, NCCL runs them beside the backward kernels);
    - `after_backward`: one all-reduce per dtype of every gradient, after the
      backward pass (on CPU, where gloo's threads would run on the cores the
      backward pass uses: nothing to overlap with, and no per-bucket work, nor
      graph splits at the buckets in a compiled step).
    """
    chosen = os.environ.get(GRADIENT_SYNC_VARIABLE, "").strip()
    if not chosen:
        return "ddp" if device.type == "cuda" else "after_backward"
    if chosen not in GRADIENT_SYNCS:
        raise ValueError(
            f"{GRADIENT_SYNC_VARIABLE} must be one of {', '.join(GRADIENT_SYNCS)} "
            f"(or unset: ddp on CUDA, after_backward on CPU). Received: {chosen!r}"
        )
    return chosen


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
