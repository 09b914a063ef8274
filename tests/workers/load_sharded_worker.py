"""One process of the PyTorch "loading without staging" job (`test_load_sharded`).

Usage: python load_sharded_worker.py WEIGHTS_H5 OUTPUT_JSON

Under a ModelParallel that splits the wide kernel across the processes, a
callback loads `WEIGHTS_H5` when training begins (the variables are DTensors
then) and reports the largest plain tensor that any Python function returned
while loading (what a process put on its device) next to the kernel's full
size, and the values loaded.
"""

from __future__ import annotations

import json
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from load_sharded_models import wide_model  # noqa: E402


def _bytes(tensor: torch.Tensor) -> int:
    """What `tensor` holds in memory: this process' part of a DTensor; none
    for the storage-less tensors DTensor's sharding propagation computes on."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if tensor.untyped_storage().device.type == "meta":
        return 0
    return tensor.numel() * tensor.element_size()


class LoadWhenTrainingBegins(keras.callbacks.Callback):
    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.report: dict = {}

    def on_train_begin(self, logs=None):
        largest = 0

        def profile(frame, event, value):
            nonlocal largest
            if event == "return" and isinstance(value, torch.Tensor):
                largest = max(largest, _bytes(value))

        sys.setprofile(profile)
        try:
            self.model.load_weights(self.path)
        finally:
            sys.setprofile(None)
        kernel = self.model.get_layer("wide").kernel
        try:
            kernel.assign(np.zeros((2, 2), "float32"))
            wrong_shape = "accepted"
        except Exception as error:  # recorded for the test to check
            wrong_shape = f"{type(error).__name__}: {error}"
        self.report = {
            "wrong_shape": wrong_shape,
            "largest_tensor_bytes": largest,
            "kernel_bytes": int(np.prod(kernel.shape)) * 4,
            "kernel_placements": [str(p) for p in kernel.value.placements],
            "kernel_local_shape": list(kernel.value.to_local().shape),
            # Gathers the split variables: collective, every process does it.
            "loaded": [w.tolist() for w in self.model.get_weights()],
        }


def main(weights_path: str, output: str) -> None:
    worker_seed.set_random_seed(7)
    model = wide_model()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["wide/kernel"] = (None, "model")
    distribution = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    load = LoadWhenTrainingBegins(weights_path)
    x = np.ones((4, 16), "float32")
    y = np.zeros((4, 1), "float32")
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), load],
    )
    with open(output, "w") as file:
        json.dump(load.report, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
