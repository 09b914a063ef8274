"""One process of a JAX job that saves or restores through the Orbax engine.

Usage: python checkpoint_jax_worker.py SCENARIO CHECKPOINT_DIR OUTPUT_JSON

- `kill` (1 process): starts a background save of 128 MiB into CHECKPOINT_DIR
  and kills itself with SIGKILL as soon as `save` returns.
- `save` (2 processes x 4 devices): trains `model()` a few steps under a
  ModelParallel layout whose `model` axis spans the processes (each process
  holds half of `hidden`'s kernel), saves it into CHECKPOINT_DIR (process 0
  creates it) and writes the manifest entries and the full saved values.
- `read` (1 process, any Keras backend): `read_arrays` of CHECKPOINT_DIR (its
  entries in `entries.json`), written with the values as lists.
- `refit` (2 processes x 4 devices): fits twice and predicts, each call with
  its own DistributeCallback, once the variables span the processes.
- `load` (2 processes x 4 devices): restores CHECKPOINT_DIR (written by one
  process, with its entries in `entries.json`) into the same layout and
  writes the full restored values.
- `save,load,refit` (any of these, comma-separated): each in turn in one job,
  `save` into CHECKPOINT_DIR/save, `load` from CHECKPOINT_DIR/load; the JSON
  holds each one's result under its name.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import keras
import numpy as np
import worker_seed

from keras_dist.backends import get_adapter
from keras_dist.backends.jax import checkpoint
from keras_dist.checkpoint.keys import saveable_variables

TIMEOUT_SECONDS = 60.0
FEATURES, HIDDEN, BATCH = 64, 256, 16


def model(seed: int = 1) -> keras.Model:
    worker_seed.set_random_seed(seed)
    net = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(3, activation="softmax", name="head"),
        ]
    )
    net.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return net


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, FEATURES)).astype("float32")
    return x, rng.integers(0, 3, size=(64,))


def model_parallel() -> kd.ModelParallel:
    # Devices in process order: the `model` axis (first) spans the 2 processes.
    mesh = kd.DeviceMesh((2, 4), ["model", "batch"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def entries(state: dict) -> dict:
    return {
        key: {"shape": list(v.shape), "dtype": str(v.value.dtype)}
        for key, v in state.items()
    }


def kill(directory: Path) -> None:
    state = {
        f"layers/big/vars/{i}": keras.Variable(np.full((1024, 8 * 1024), i, "float32"))
        for i in range(4)
    }
    checkpoint.save(directory, state, background=True)
    os.kill(os.getpid(), signal.SIGKILL)


def read(directory: Path, output: Path) -> None:
    import jax  # noqa: PLC0415

    saved = json.loads((directory / "entries.json").read_text())
    arrays = checkpoint.read_arrays(directory, saved)
    result = {
        "backend": keras.backend.backend(),
        "jax_platforms": jax.config.jax_platforms,
        "values": {key: value.tolist() for key, value in arrays.items()},
        "dtypes": {key: str(value.dtype) for key, value in arrays.items()},
    }
    output.write_text(json.dumps(result))


class LoadAtTrainEnd(keras.callbacks.Callback):
    """Restores `directory` into the model once fit has laid it out."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def on_train_end(self, logs=None):
        saved = json.loads((self.directory / "entries.json").read_text())
        checkpoint.load(self.directory, saveable_variables(self.model), saved)


def gathered(state: dict) -> dict:
    """The full value of every variable, on every process (a collective)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return {
        key: np.asarray(
            multihost_utils.process_allgather(variable.value, tiled=True)
        ).tolist()
        for key, variable in state.items()
    }


def refit() -> dict:
    """Two fits and a predict, each with its own DistributeCallback, of a
    model whose variables span the processes after the first."""
    x, y = data()
    net = model()
    for _ in range(2):
        net.fit(
            x[:BATCH],
            y[:BATCH],
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(model_parallel())],
        )
    predictions = net.predict(
        x[:BATCH], verbose=0, callbacks=[kd.DistributeCallback(model_parallel())]
    )
    kernel = net.get_layer("hidden").kernel.value
    return {
        "kernel_shards": sorted(
            {tuple(s.data.shape) for s in kernel.addressable_shards}
        ),
        "predictions": np.asarray(predictions).tolist(),
        "iterations": int(net.optimizer.iterations.value),
        "values": gathered(saveable_variables(net)),
    }


def save_or_load(scenario: str, directory: Path) -> dict:
    callbacks = [kd.DistributeCallback(model_parallel())]
    if scenario == "load":
        callbacks.append(LoadAtTrainEnd(directory))
    elif scenario != "save":
        raise ValueError(f"Unknown scenario {scenario!r}")
    x, y = data()
    net = model(seed=1 if scenario == "save" else 7)
    steps = 3 if scenario == "save" else 1
    net.fit(
        x[: steps * BATCH],
        y[: steps * BATCH],
        batch_size=BATCH,
        verbose=0,
        callbacks=callbacks,
    )
    state = saveable_variables(net)
    result: dict = {"rank": get_adapter().process_id()}
    if scenario == "save":
        if result["rank"] == 0:
            directory.mkdir()
        get_adapter().barrier("checkpoint directory", timeout_seconds=TIMEOUT_SECONDS)
        checkpoint.save(directory, state, background=True).wait(TIMEOUT_SECONDS)
        result["entries"] = entries(state)
    kernel = net.get_layer("hidden").kernel.value
    result["kernel_shards"] = sorted(
        {tuple(s.data.shape) for s in kernel.addressable_shards}
    )
    result["values"] = gathered(state)
    return result


def main(scenario: str, directory: Path, output: Path) -> None:
    if scenario == "kill":
        kill(directory)
        return
    if scenario == "read":
        read(directory, output)
        return
    kd.initialize()
    if "," not in scenario:
        result = refit() if scenario == "refit" else save_or_load(scenario, directory)
        output.write_text(json.dumps(result))
        return
    # Several scenarios in turn in one job (one start-up: CI's time), each
    # from a cleared Keras session, each with its directory in CHECKPOINT_DIR
    # (`save` writes CHECKPOINT_DIR/save, `load` reads CHECKPOINT_DIR/load).
    results = {}
    for name in scenario.split(","):
        keras.backend.clear_session()
        if name == "refit":
            results[name] = refit()
        else:
            results[name] = save_or_load(name, directory / name)
    output.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
