"""Small sums over the processes that ride in DDP's gradient all-reduce.

Each training step under DDP sums its metric states (and averages BatchNorm's
moving statistics) over the processes. As a collective of its own that is a
second wait per step beside DDP's bucketed gradient all-reduce; on CPU with gloo
each wait costs far more than its bytes. `GradientRides` is a DDP communication
hook doing what DDP's default does (average each bucket over the processes, one
all-reduce) that also carries a tensor handed to `ride` before backward: it is
appended to the first bucket reduced, summed in the same all-reduce, and written
back when it completes (before `backward()` returns, since DDP waits for every
bucket). When no bucket carries it (no backward ran, DDP's `no_sync`, or a
bucket of 16-bit gradients) the wait sums it with an all-reduce of its own, so
the result is the same either way.

The sum is taken in the bucket's dtype (float32 for float32 gradients): for
float32 values, as metric states are, a sum over two processes is the same
number as the float64 sum rounded back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_distributed


class GradientRides:
    """A DDP comm hook (`ddp.register_comm_hook(None, rides.hook)`) that averages
    gradient buckets and carries one pending sum (see the module)."""

    def __init__(self, world_size: int):
        self._world_size = world_size
        self._pending: torch.Tensor | None = None
        self._carried: Any = None

    def ride(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Sum float tensor `tensor` over the processes, in place, within the
        next backward's gradient all-reduce; return the wait for the sum."""
        self._pending, self._carried = tensor, None

        def wait() -> None:
            carried, self._carried = self._carried, None
            if carried is not None:
                carried.wait()
                return
            # No bucket took it: its own all-reduce, the same sum.
            self._pending = None
            torch_distributed.all_reduce(tensor, op=torch_distributed.ReduceOp.SUM)

        return wait

    # Unannotated: DDP checks the annotations, which `from __future__ import
    # annotations` makes strings.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        gradients = bucket.buffer()
        gradients.div_(self._world_size)
        extra = self._pending
        if extra is None or gradients.dtype not in (torch.float32, torch.float64):
            work = torch_distributed.all_reduce(gradients, async_op=True)
            return work.get_future().then(lambda done: done.value()[0])
        self._pending = None
        size = gradients.numel()
        flat = torch.cat([gradients, extra.to(gradients.dtype)])
        work = torch_distributed.all_reduce(flat, async_op=True)

        def written_back(done: torch.futures.Future) -> torch.Tensor:
            summed = done.value()[0]
            extra.copy_(summed[size:])
            return summed[:size]

        self._carried = work.get_future().then(written_back)
        return self._carried
