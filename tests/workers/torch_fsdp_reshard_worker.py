"""One process of a PyTorch FSDP job that checks when whole weights are freed,
and what the optimizer's state costs.

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

The optimizer's state (`optimizer_state`): what malloc holds more after Keras
builds Adam's slots inside a `kd.FSDP` fit (split as each is made: half of
the 8 bytes a parameter on 2 processes), and `kd.FSDP()` as it comes
(`keep_optimizer_sharded=True`): the slots stay split between two fits,
`model.save` from every process writes them whole, a later plain `fit` gathers
them first, and the weights and state match one device at every point; a
`model.save` on process 0 alone fails with a clear error within the timeout.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import sys
import time

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
            "fordblks keepcost"
        ).split()
    ]


def allocated_bytes() -> int:
    """Bytes malloc has handed out (glibc's `mallinfo2`: torch's CPU tensors)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def slot_build_growth() -> float:
    """What malloc holds more after Keras builds Adam inside a kd.FSDP fit,
    as a fraction of Adam's whole state (8 bytes a parameter)."""
    worker_seed.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(512, use_bias=False) for _ in range(4)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    growth = []
    build = model.optimizer.build

    def measured_build(variables):
        before = allocated_bytes()
        build(variables)
        growth.append(allocated_bytes() - before)

    model.optimizer.build = measured_build
    rng = np.random.default_rng(1)
    model.fit(
        rng.normal(size=(8, 512)).astype("float32"),
        rng.normal(size=(8, 512)).astype("float32"),
        batch_size=8,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.FSDP(min_size=0))],
    )
    return growth[0] / (8 * model.count_params())


def optimizer_state(x: np.ndarray, y: np.ndarray, directory: pathlib.Path) -> dict:
    """`FSDP(keep_optimizer_sharded=True)` against one device: two fits, a
    save between them, then a plain fit."""
    seen: dict = {}
    states = {}
    for name, distribution in (
        # The default keeps the state split (issue 40).
        ("kept", kd.FSDP(min_size=0)),
        ("one_device", None),
    ):
        worker_seed.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        callbacks = [kd.DistributeCallback(distribution)] if distribution else []
        fit = dict(batch_size=8, shuffle=False, verbose=0)
        model.fit(x, y, callbacks=callbacks, **fit)
        slots = [v for v in model.optimizer.variables if len(v.shape) > 0]
        seen[f"{name}_split_after_fit"] = [isinstance(v._value, DTensor) for v in slots]
        seen[f"{name}_weights_split_after_fit"] = any(
            isinstance(v._value, DTensor) for v in model.weights
        )
        seen[f"{name}_local_fraction"] = sum(
            (v._value.to_local() if isinstance(v._value, DTensor) else v._value).numel()
            for v in slots
        ) / sum(int(np.prod(v.shape)) for v in slots)
        first = [np.asarray(v) for v in model.optimizer.variables]  # collective
        path = directory / f"{name}.keras"
        model.save(path)  # every process; process 0 writes
        model.fit(x, y, callbacks=callbacks, **fit)  # goes on from the split state
        second = [np.asarray(v) for v in model.optimizer.variables]
        model.fit(x, y, **fit)  # plain Keras: the state is gathered first
        seen[f"{name}_split_after_plain_fit"] = any(
            isinstance(v._value, DTensor) for v in model.optimizer.variables
        )
        states[name] = (first, second, model.get_weights(), path)
    kept, one = states["kept"], states["one_device"]

    def difference(ours: list, theirs: list) -> float:
        return max(
            float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs, strict=True)
        )

    seen["state_difference_after_first_fit"] = difference(kept[0], one[0])
    seen["state_difference_after_second_fit"] = difference(kept[1], one[1])
    seen["weight_difference_after_plain_fit"] = difference(kept[2], one[2])
    loaded = keras.saving.load_model(kept[3])
    seen["saved_state_difference"] = difference(
        [np.asarray(v) for v in loaded.optimizer.variables], one[0]
    )
    return seen


def save_on_one_process(x: np.ndarray, y: np.ndarray, directory: pathlib.Path) -> dict:
    """`model.save` on process 0 alone while `kd.FSDP` keeps the optimizer's
    state split (the default): it cannot gather the state, and says so within
    `KERAS_DIST_INIT_TIMEOUT` seconds (5 here) instead of waiting forever.
    Process 1 waits, outside any collective, until process 0 is done."""
    worker_seed.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.FSDP(min_size=0))],
    )
    done = directory / "one_process_save_done"
    seen: dict = {}
    if kd.process_id() == 0:
        os.environ["KERAS_DIST_INIT_TIMEOUT"] = "5"
        started = time.monotonic()
        try:
            model.save(directory / "rank0_only.keras")
            seen["error"] = None
        except RuntimeError as error:
            seen["error"] = str(error)
        seen["seconds"] = time.monotonic() - started
        done.write_text("done")
    else:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return seen


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
        "slot_build_growth": slot_build_growth(),
        "optimizer_state": optimizer_state(x, y, pathlib.Path(sys.argv[1]).parent),
        "alive_in_backward": seen,
        "save_on_one_process": save_on_one_process(
            x, y, pathlib.Path(sys.argv[1]).parent
        ),
        "difference": max(
            float(np.max(np.abs(ours - theirs)))
            for ours, theirs in zip(*weights, strict=True)
        ),
    }
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
