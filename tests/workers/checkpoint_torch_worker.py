"""One process of a PyTorch checkpoint-engine test job (2 gloo processes).

Usage: python checkpoint_torch_worker.py SCENARIO DIRECTORY OUTPUT_JSON
       python checkpoint_torch_worker.py SCENARIO,... DIRECTORY,... OUTPUT_JSON
       (each scenario with its directory in turn, in one job; the JSON holds
       the list of their results)

- `save`: trains the model under DataParallel (DDP) and saves it from a
  callback at the end of training with `background=True` into
  `DIRECTORY/ddp`; then trains a fresh model under ModelParallel (DTensor,
  kernels split between the processes) and saves it with `background=False`
  into `DIRECTORY/mp`. Records what a restore must give back.
- `restore`: restores `DIRECTORY/one` (written by one process) into fresh
  models: under ModelParallel with `load`, under ModelParallel with
  `read_arrays` + `assign_arrays`, under DDP with `load`.

The test imports `build`, `fit_data`, `probe` and `entries_of` from here.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import worker_seed

import keras_dist as kd
from keras_dist.checkpoint.keys import saveable_variables

HIDDEN = 64


def build(seed: int) -> keras.Model:
    """A small model with a Dropout (a seed generator) and Adam (slots)."""
    worker_seed.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
            keras.layers.Dropout(0.1, name="drop"),
            keras.layers.Dense(4, name="out"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def fit_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 6)).astype("float32")
    return x, rng.normal(size=(24, 4)).astype("float32")


def probe() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(5, 6)).astype("float32")


def predict(model: keras.Model) -> list:
    return keras.ops.convert_to_numpy(model(probe(), training=False)).tolist()


def entries_of(state: dict) -> dict:
    return {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in state.items()}


def model_parallel() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden/bias"] = ("model",)
    layout_map["out/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


class SaveAtEnd(keras.callbacks.Callback):
    """Saves at the last epoch's end, inside `fit` (the variables still laid
    out by the distribution); training ends right after, so the model after
    `fit` is the one saved."""

    def __init__(self, directory: str, background: bool, epochs: int):
        super().__init__()
        self.directory, self.background, self.epochs = directory, background, epochs
        self.record: dict = {}

    def on_epoch_end(self, epoch, logs=None):
        if epoch != self.epochs - 1:
            return
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        from keras_dist.backends.torch import checkpoint  # noqa: PLC0415

        state = saveable_variables(self.model)
        pending = checkpoint.save(self.directory, state, background=self.background)
        held = {k: v.value for k, v in state.items()}
        # Training may change the variables right after save returns.
        self.record = {
            "returned_done": pending.done(),
            "sharded": sorted(k for k, v in held.items() if isinstance(v, DTensor)),
            "metrics": {
                k: float(v) for k, v in self.model.get_metrics_result().items()
            },
        }
        pending.wait(60)
        self.record["entries"] = entries_of(state)


def save(directory: str, mode: str, background: bool) -> dict:
    model = build(seed=10 + kd.process_id())  # process 0's weights win
    distribution = kd.DataParallel() if mode == "ddp" else model_parallel()
    x, y = fit_data()
    saver = SaveAtEnd(os.path.join(directory, mode), background, epochs=2)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), saver],
    )
    return {
        **saver.record,
        "predictions": predict(model),
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "values": {
            k: np.asarray(v).tolist()
            for k, v in saveable_variables(model).items()
            if not k.startswith("metrics/")
        },
    }


def restore(directory: str, mode: str, how: str) -> dict:
    """A fresh model restored from `directory` under `mode`, its layout
    switched on by hand (as `fit` would), then off again."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from keras_dist.backends.torch import checkpoint  # noqa: PLC0415

    model = build(seed=50 + kd.process_id())
    distribution = kd.DataParallel() if mode == "ddp" else model_parallel()
    switch = kd.DistributeCallback(distribution)
    switch.set_model(model)  # lays the variables out now
    state = saveable_variables(model)
    entries = entries_of(state)
    if how == "load":
        checkpoint.load(directory, state, entries)
    else:
        checkpoint.assign_arrays(state, checkpoint.read_arrays(directory, entries))
    held = {
        k: list(v.value.to_local().shape)
        for k, v in state.items()
        if isinstance(v.value, DTensor)
    }
    local_metrics = {
        k: float(np.asarray(v)) for k, v in state.items() if k.startswith("metrics/")
    }
    metrics = {k: float(v) for k, v in model.get_metrics_result().items()}
    switch.close()
    return {
        "local_shapes": held,
        "local_metrics": local_metrics,
        "metrics": metrics,
        "predictions": predict(model),
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }


def run(scenario: str, directory: str) -> dict:
    if scenario == "save":
        result = {
            "ddp": save(directory, "ddp", background=True),
            "mp": save(directory, "mp", background=False),
        }
    elif scenario == "restore":
        result = {
            "mp_load": restore(directory, "mp", "load"),
            "mp_assign": restore(directory, "mp", "assign"),
            "ddp_load": restore(directory, "ddp", "load"),
        }
    else:
        raise ValueError(f"Unknown scenario {scenario!r}; use 'save' or 'restore'.")
    result["processes"] = kd.num_processes()
    return result


def main() -> None:
    scenarios, directories, output = (
        sys.argv[1].split(","),
        sys.argv[2].split(","),
        sys.argv[3],
    )
    kd.initialize()
    runs = []
    for scenario, directory in zip(scenarios, directories, strict=True):
        keras.backend.clear_session()
        runs.append(run(scenario, directory))
    with open(output, "w") as file:
        json.dump(runs[0] if len(runs) == 1 else runs, file)


if __name__ == "__main__":
    main()
