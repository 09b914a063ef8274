"""The torch process group's world and its bounded barrier, shared by the
adapter and the modules it imports (`split_state`), none of which may import
the adapter back."""

from __future__ import annotations

import datetime

import torch.distributed as torch_distributed


def world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    if torch_distributed.is_available() and torch_distributed.is_initialized():
        return torch_distributed.get_world_size(), torch_distributed.get_rank()
    return 1, 0


def bounded_barrier(timeout_seconds: float) -> None:
    """Wait for every process at most `timeout_seconds`; raise what torch
    raised when they do not all come (gloo's monitored barrier names the
    ranks that did not; under nccl the process group's own timeout applies).
    Nothing to wait for in a one-process job."""
    if world()[0] == 1:
        return
    if torch_distributed.get_backend() == "gloo":
        torch_distributed.monitored_barrier(
            timeout=datetime.timedelta(seconds=timeout_seconds)
        )
    else:
        torch_distributed.barrier()
