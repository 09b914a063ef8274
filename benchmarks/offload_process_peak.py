"""The device memory a whole offloaded `fit` holds against its step's plan:
N x Dense(WIDTH) (float32, Adam) under `kd.DataParallel(offload="optimizer")`
on this process' devices, one JSON object (`RESULT {...}`, and `--out`).

- `planned`: the train step `fit` runs, compiled for this process' devices
  (the distribution's own mesh) on abstract values: `peak_gib` is XLA's
  arguments + outputs + temporaries less what the outputs alias, per device.
- `process_peak_gib`: the first device's `peak_bytes_in_use` (JAX's
  `memory_stats()`; None where the platform keeps none, as JAX's CPU), read
  after each moment in turn (the peak only grows): `after_build` (the
  model made), `after_slots` (the optimizer's slots made, at `fit`'s
  start), `after_first_step`, `after_fit`, `after_save` (a `kd.Checkpoint`
  save), `after_restore` (`kd.restore` into a new model under the same
  distribution: its optimizer built, its slots loaded).
- `slot_memory_kinds`, `restored_slot_memory_kinds`: where Adam's moments
  live during `fit` and after the restore.

On one TPU v5e chip (20 layers of 8192, batch 16; the save and restore on 6
layers, since a checkpoint holds the whole state on the host's disk):

```shell
export KERAS_BACKEND=jax
python benchmarks/offload_process_peak.py --layers 20 --no-save-restore
python benchmarks/offload_process_peak.py --layers 6
```

Runs on a CPU too (small: `--layers 3 --width 256`), where the peaks are None.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
from typing import Any

GIB = 2**30


def device_gib(stat: str = "peak_bytes_in_use") -> float | None:
    """The first device's `memory_stats()[stat]` in GiB (None where the
    platform keeps none, as JAX's CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or stat not in stats:
        return None
    return round(stats[stat] / GIB, 3)


def mark(peaks: dict, moment: str) -> None:
    """The peak so far, as of `moment` (printed too: a run cut short keeps
    what it measured)."""
    peaks[moment] = device_gib()
    print(f"PEAK {moment} {peaks[moment]}", flush=True)


def make_model(layers: int, width: int) -> Any:
    import keras

    inputs = keras.Input((width,))
    x = inputs
    for _ in range(layers):
        x = keras.layers.Dense(width)(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def planned_peak(model: Any, distribution: Any, batch: int, width: int) -> dict:
    """The train step compiled for the distribution's own devices."""
    import jax

    from keras_dist.backends import get_adapter

    data = (
        jax.ShapeDtypeStruct((batch, width), "float32"),
        jax.ShapeDtypeStruct((batch, width), "float32"),
    )
    try:
        step = get_adapter().compile_steps(model, distribution, data, ("train",))[
            "train"
        ]
    except Exception as error:  # report it, measure the rest
        return {"error": f"{type(error).__name__}: {str(error)[:400]}"}
    if step.get("error"):
        return {"error": str(step["error"])[:400]}
    out = {}
    for key in ("peak_bytes", "argument_bytes", "temp_bytes", "host_peak_bytes"):
        if step.get(key) is not None:
            out[key.replace("_bytes", "_gib")] = round(step[key] / GIB, 3)
    return out


def save(model: Any, distribution: Any, xs: Any, ys: Any, args: Any, out: dict) -> str:
    """A `kd.Checkpoint` save: one more epoch, saved at its end."""
    import keras_dist as kd

    directory = tempfile.mkdtemp(prefix="offload_peak_", dir=args.directory)
    model.fit(
        xs,
        ys,
        batch_size=args.batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(distribution),
            kd.Checkpoint(directory, save_freq="epoch"),
        ],
    )
    mark(out["process_peak_gib"], "after_save")
    return directory


def restore(directory: str, distribution: Any, args: Any, out: dict) -> None:
    """`kd.restore` into a new model (its optimizer never built) under the
    same distribution."""
    import keras_dist as kd

    out["in_use_before_restore_gib"] = device_gib("bytes_in_use")
    restored = make_model(args.layers, args.width)
    with distribution.scope():
        out["restored_step"] = kd.restore(restored, directory)
    mark(out["process_peak_gib"], "after_restore")
    out["restored_slot_memory_kinds"] = sorted(
        {
            str(variable.value.sharding.memory_kind)
            for variable in restored.optimizer.variables
            if variable.name.endswith(("momentum", "velocity"))
        }
    )
    shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import keras
    import numpy as np

    import keras_dist as kd

    out: dict[str, Any] = {"config": vars(args), "process_peak_gib": {}}
    peaks = out["process_peak_gib"]
    keras.utils.set_random_seed(0)
    model = make_model(args.layers, args.width)
    mark(peaks, "after_build")
    distribution = kd.DataParallel(offload="optimizer")
    kinds: set[str] = set()

    class Watch(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            mark(peaks, "after_slots")
            out["in_use_after_slots_gib"] = device_gib("bytes_in_use")

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                mark(peaks, "after_first_step")
            for variable in self.model.optimizer.variables:
                if variable.name.endswith(("momentum", "velocity")):
                    kinds.add(str(variable.value.sharding.memory_kind))

    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    xs = rng.standard_normal((rows, args.width), dtype=np.float32)
    ys = 0.1 * rng.standard_normal((rows, args.width), dtype=np.float32)
    model.fit(
        xs,
        ys,
        batch_size=args.batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), Watch()],
    )
    mark(peaks, "after_fit")
    out["slot_memory_kinds"] = sorted(kinds)
    out["planned"] = planned_peak(model, distribution, args.batch, args.width)
    if args.save_restore:
        directory = save(model, distribution, xs, ys, args, out)
        del model  # the trained model gone before the restore
        gc.collect()
        restore(directory, distribution, args, out)
    planned = out["planned"].get("peak_gib")
    highest = max((p for p in peaks.values() if p is not None), default=None)
    if planned is not None and highest is not None:
        out["process_over_plan_gib"] = round(highest - planned, 3)
    return out


def main() -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--save-restore",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also save a checkpoint and restore it (writes the whole state)",
    )
    parser.add_argument("--directory", default=None, help="where to save")
    args = parser.parse_args()
    try:
        out = run(args)
        out["ok"] = True
    except Exception as error:  # an out-of-memory is a result here
        out = {"config": vars(args), "ok": False}
        out["error"] = f"{type(error).__name__}: {str(error)[:800]}"
    text = json.dumps(out)
    print("RESULT " + text, flush=True)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
