"""TensorFlow adapter: logical devices; tf.distribute training comes later.

Devices and process counts work today. Training under a distribution is not
implemented yet: those methods raise `NotImplementedError` instead of letting
Keras ignore the distribution and train on one device.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_dist.backends.base import BackendAdapter

_NOT_YET = (
    "{what} is not implemented yet for the TensorFlow backend in keras_dist; "
    "use KERAS_BACKEND=jax for distributed training meanwhile."
)


def _device_name(logical_device: Any) -> str:
    # Logical devices are named like "/device:CPU:0".
    index = logical_device.name.rsplit(":", 1)[-1]
    return f"{logical_device.device_type.lower()}:{index}"


class TensorFlowAdapter(BackendAdapter):
    name = "tensorflow"

    def simulate_cpu_devices(self, count: int) -> None:
        cpus = tf.config.list_physical_devices("CPU")
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * count
            )
        except RuntimeError:
            present = len(tf.config.list_logical_devices("CPU"))
            if present != count:
                raise RuntimeError(
                    f"KERAS_DIST_CPU_DEVICES={count} came too late: TensorFlow "
                    f"already started with {present} CPU devices. Set the "
                    "variable before the first TensorFlow operation."
                ) from None

    def list_devices(self, device_type: str | None = None) -> list[str]:
        if device_type is None:
            for candidate in ("TPU", "GPU"):
                if tf.config.list_logical_devices(candidate):
                    device_type = candidate
                    break
            else:
                device_type = "CPU"
        devices = tf.config.list_logical_devices(device_type.upper())
        return [_device_name(device) for device in devices]

    def local_device_count(self, device_type: str | None = None) -> int:
        return len(self.list_devices(device_type))

    def num_processes(self) -> int:
        return 1

    def process_id(self) -> int:
        return 0

    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        raise NotImplementedError(_NOT_YET.format(what="Multi-process TensorFlow"))

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


ADAPTER = TensorFlowAdapter()
