"""JAX: what one device holds while an FSDP model is built, laid out or restored.

Builds the wide MLP of `fsdp_memory.py` (six `Dense(2048)` layers and a head,
25.2 M parameters) on 8 simulated CPU devices and reports, per device, the most
bytes of live JAX arrays seen while:

- `under`: the model is built inside `kd.FSDP().scope()` (each variable gets
  its layout when it is created);
- `before`: the model is built without a distribution, then a `fit` of one
  step under `kd.DistributeCallback(kd.FSDP())` lays it out;
- `restore`: `kd.restore` reads a `kd.Checkpoint` of it into a model built
  under the scope (Orbax reads each device's shards).

The bytes (more than each device held when the block started) are read
(`jax.live_arrays()`, each array's addressable shards by device) right before
and right after every `jax.device_put` and every value a
Keras variable takes (`JaxVariable._direct_assign`, `_initialize_with_initializer`),
and every 1 ms by a thread: a whole copy of a split variable on one device shows
as that device holding more than its share. Also printed: the largest single
array seen on one device, and the share a device should hold (the model's
bytes / 8, plus the replicated ones). Each mode runs in its own process.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/jax_build_memory.py --compare
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import keras
import numpy as np

WIDTH, LAYERS = 2048, 6


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [
            keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")
            for i in range(LAYERS)
        ]
        + [keras.layers.Dense(10, name="logits")],
        name="wide_mlp",
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class DeviceBytes:
    """The most bytes of live arrays seen on each device, and the largest
    single array's bytes on one device, over the `watch()` block."""

    def __init__(self) -> None:
        self.most: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self.largest_piece = 0
        self._lock = threading.Lock()

    def growth(self) -> dict[str, int]:
        """The most bytes held on each device over what it held when the
        block started."""
        return {key: most - self.start.get(key, 0) for key, most in self.most.items()}

    def look(self) -> None:
        held: dict[str, int] = {}
        largest = 0
        for array in jax.live_arrays():
            try:
                shards = array.addressable_shards
            except Exception:  # deleted meanwhile
                continue
            for shard in shards:
                nbytes = shard.data.nbytes
                key = str(shard.device)
                held[key] = held.get(key, 0) + nbytes
                largest = max(largest, nbytes)
        with self._lock:
            for key, nbytes in held.items():
                self.most[key] = max(self.most.get(key, 0), nbytes)
            self.largest_piece = max(self.largest_piece, largest)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        from keras_dist.keras_compat.backend import variable_class  # noqa: PLC0415

        variable = variable_class("jax")
        originals = {
            "_direct_assign": variable._direct_assign,
            "_initialize_with_initializer": variable._initialize_with_initializer,
        }
        device_put = jax.device_put

        def around(function: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.look()
                result = function(*args, **kwargs)
                self.look()
                return result

            return call

        self.look()
        self.start, self.most = dict(self.most), {}
        self.largest_piece = 0
        for name, function in originals.items():
            setattr(variable, name, around(function))
        jax.device_put = around(device_put)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                self.look()
                time.sleep(0.001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            for name, function in originals.items():
                setattr(variable, name, function)
            jax.device_put = device_put
            self.look()


def run_once(mode: str) -> dict:
    devices = len(jax.devices())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, WIDTH)).astype("float32")
    y = rng.integers(0, 10, size=(64,)).astype("int32")
    distribution = kd.FSDP()
    seen = DeviceBytes()
    if mode == "under":
        with seen.watch(), distribution.scope():
            model = build()
    elif mode == "before":
        with seen.watch():
            model = build()
            model.fit(
                x, y, batch_size=64, epochs=1, verbose=0,
                callbacks=[kd.DistributeCallback(distribution)],
            )  # fmt: skip
    elif mode == "restore":
        with tempfile.TemporaryDirectory() as directory:
            with distribution.scope():
                saved = build()
            saved.fit(
                x, y, batch_size=64, epochs=1, verbose=0,
                callbacks=[
                    kd.DistributeCallback(distribution),
                    kd.Checkpoint(directory, save_on_background=False),
                ],
            )  # fmt: skip
            with distribution.scope():
                model = build()
                model.optimizer.build(model.trainable_variables)
            del saved
            import gc  # noqa: PLC0415

            gc.collect()
            seen = DeviceBytes()
            with seen.watch(), distribution.scope():
                kd.restore(model, directory)
    else:
        raise ValueError(f"mode must be under, before or restore. Received: {mode!r}")
    params = model.count_params()
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    replicated = sum(
        int(np.prod(v.shape)) * 4
        for v in model.weights
        if all(axis is None for axis in distribution.layout_for_variable(v).axes)
    )
    largest_variable = max(int(np.prod(v.shape)) * 4 for v in model.weights)
    growth = seen.growth()
    most = max(growth.values())
    return {
        "mode": mode,
        "devices": devices,
        "params": params,
        "weights_mib": weight_bytes / 2**20,
        "share_mib": ((weight_bytes - replicated) / devices + replicated) / 2**20,
        "largest_variable_mib": largest_variable / 2**20,
        "most_on_one_device_mib": most / 2**20,
        "most_per_device_mib": {k: v / 2**20 for k, v in sorted(growth.items())},
        "largest_piece_on_one_device_mib": seen.largest_piece / 2**20,
        "keras": keras.__version__,
    }


def compare() -> None:
    for mode in ("under", "before", "restore"):
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode],
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_DIST_CPU_DEVICES": "8"},
            check=False,
        )
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.pop("most_per_device_mib")
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in result.items()}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("under", "before", "restore"))
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    if args.compare:
        compare()
    elif args.mode is None:
        raise ValueError("Pass --mode under|before|restore, or --compare.")
    else:
        print(json.dumps(run_once(args.mode)), flush=True)


if __name__ == "__main__":
    main()
