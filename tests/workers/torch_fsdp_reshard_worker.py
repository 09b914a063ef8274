"""One process of a PyTorch FSDP job that checks when whole weights are freed.

Usage: python torch_fsdp_reshard_worker.py OUTPUT_JSON

`kd.FSDP` on the batch axis alone gathers each layer's whole weights for its
call and, as FSDP2's default `reshard_after_forward=True`, frees them when
the call ends and gathers them again in the layer's backward. The second
layer here keeps a weak reference to the memory of the whole kernel it
computed with and
looks at it when backward reaches the layer's output, before the layer's own
backward ops: the whole kernel must be gone by then (a matmul saves it for
backward; without resharding that keeps it alive). The fit must still match
the same fit on one device.

`Watched` is not the first layer: a matmul saves its second operand only when
the first one (here the previous layer's output) needs a gradient.
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
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402


class Record:
    """What `Watched` saw, one entry per backward (a plain object: Keras would
    track, and copy, a list set as a layer attribute)."""

    def __init__(self) -> None:
        self.alive: list[bool] = []


class Watched(keras.layers.Dense):
    """A Dense that records, when backward reaches its output, whether the
    whole kernel its forward used is still alive."""

    def __init__(self, record: Record, **kwargs):
        super().__init__(**kwargs)
        self.record = record

    def call(self, inputs):
        kernel = self.kernel.value
        outputs = super().call(inputs)
        if isinstance(outputs, torch.Tensor) and outputs.requires_grad:
            # The memory's liveness, not the tensor object's: autograd may
            # save a shallow copy of a tensor, sharing its storage.
            whole = StorageWeakRef(kernel.untyped_storage())
            del kernel
            alive = self.record.alive
            outputs.register_hook(lambda grad: alive.append(not whole.expired()))
        return outputs


def build(record: Record) -> keras.Model:
    worker_seed.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="first"),
            Watched(record, units=8, activation="tanh", name="watched"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    weights, seen = [], {}
    for name, distribution in (("fsdp", kd.FSDP(min_size=0)), ("one_device", None)):
        record = Record()
        model = build(record)
        model.fit(
            x,
            y,
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution)] if distribution else [],
        )
        weights.append(model.get_weights())
        seen[name] = record.alive
    result = {
        "process_id": kd.process_id(),
        "alive_in_backward": seen,
        "difference": max(
            float(np.max(np.abs(ours - theirs)))
            for ours, theirs in zip(*weights, strict=True)
        ),
    }
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
