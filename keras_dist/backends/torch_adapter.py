"""PyTorch adapter: one process per device, `torch.distributed` process groups.

Devices, process counts and joining a job work today. Training through
DistributedDataParallel and DTensor layouts are not implemented yet: those
methods raise `NotImplementedError` rather than train on one device silently.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as torch_distributed

from keras_dist.backends.base import BackendAdapter

_NOT_YET = (
    "{what} is not implemented yet for the PyTorch backend in keras_dist; use "
    "KERAS_BACKEND=jax for distributed training meanwhile."
)


def _accelerator_type() -> str | None:
    return "gpu" if torch.cuda.is_available() else None


class TorchAdapter(BackendAdapter):
    name = "torch"

    def simulate_cpu_devices(self, count: int) -> None:
        if count != 1:
            raise NotImplementedError(
                f"KERAS_DIST_CPU_DEVICES={count}: PyTorch runs one device per "
                "process. Start several processes instead, e.g. "
                f"`keras-dist launch --nproc-per-node {count} script.py`."
            )

    def _world(self) -> tuple[int, int]:
        if torch_distributed.is_available() and torch_distributed.is_initialized():
            return torch_distributed.get_world_size(), torch_distributed.get_rank()
        return 1, 0

    def list_devices(self, device_type: str | None = None) -> list[str]:
        device_type = device_type or _accelerator_type() or "cpu"
        world_size, _ = self._world()
        if device_type == "gpu":
            per_process = torch.cuda.device_count() if world_size == 1 else 1
            return [f"gpu:{index}" for index in range(per_process * world_size)]
        if device_type == "cpu":
            return [f"cpu:{index}" for index in range(world_size)]
        return []

    def local_device_count(self, device_type: str | None = None) -> int:
        world_size, _ = self._world()
        return len(self.list_devices(device_type)) // world_size

    def num_processes(self) -> int:
        return self._world()[0]

    def process_id(self) -> int:
        return self._world()[1]

    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        try:
            torch_distributed.init_process_group(
                backend=backend,
                init_method=f"tcp://{coordinator_address}",
                world_size=num_processes,
                rank=process_id,
                timeout=datetime.timedelta(seconds=timeout_seconds),
            )
        except Exception as error:  # torch raises DistStoreError, RuntimeError...
            raise RuntimeError(
                f"Process {process_id} of {num_processes} could not join the job "
                f"coordinated at {coordinator_address} within {timeout_seconds:g} "
                f"s: {error}"
            ) from error

    def to_backend_mesh(self, device_mesh: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="DeviceMesh.backend_mesh"))

    def to_backend_layout(self, tensor_layout: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="TensorLayout.backend_layout"))

    def distribute_tensor(self, tensor: Any, tensor_layout: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="distribute_tensor"))

    def activate(self, model: Any, distribution: Any) -> None:
        raise NotImplementedError(
            _NOT_YET.format(what=f"Training under {type(distribution).__name__}")
        )

    def deactivate(self, model: Any) -> None:
        raise NotImplementedError(_NOT_YET.format(what="Distributed training"))


ADAPTER = TorchAdapter()
