"""`DistributeCallback("auto")`: how long choosing takes, and how the step it
chooses compares with the best one picked by hand, in one run.

Two parts:

    search   `plan_auto` (what "auto" runs when a call starts, without the
             training) on a stack of `--layers` Dense(`--width`) layers with
             Adam, for this job's devices with `--device-memory` a device:
             the seconds it takes and what it chooses. With `--layers 40
             --width 8192` (2.7 B parameters) this is the budget's case: a
             model of a few billion parameters.
    race     `--race`: each hand-picked candidate (DataParallel, FSDP, FSDP
             x TP on every model axis; CPU devices have no limit, so each
             trains) trained for `--steps` steps of the
             model, timed after a warm-up step; the chosen one's median ms a
             step over the best hand-picked one's: the ratio (1.0: "auto"
             picked the fastest of them; above 1: slower by that much).

Run (8 simulated CPU devices; the race needs a model that trains here):

    KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 python benchmarks/auto.py \\
        --layers 4 --width 1024 --device-memory 1GiB --race
    KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 python benchmarks/auto.py \\
        --layers 40 --width 8192 --device-memory 16GiB

On a GPU or a TPU, `--device-memory engine` takes the limit the devices
report.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import keras
import numpy as np

import keras_dist as kd
from keras_dist.cli import parse_memory
from keras_dist.planner.candidates import Candidate, model_axis_sizes
from keras_dist.training.auto import plan_auto


def build(layers: int, width: int):
    def make():
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
        )
        model.compile(optimizer="adam", loss="mse")
        return model

    return make


def step_ms(model_function, candidate, x, y, batch, steps):
    """The median ms a step of `candidate`'s distribution, made for the very
    model trained (a tensor-parallel map names its variables)."""
    model = model_function()
    mesh = kd.DeviceMesh(tuple(candidate.mesh.values()), tuple(candidate.mesh))
    distribution = candidate.distribution_function(model)(mesh)
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            times.append(time.perf_counter() - self.began)

    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Timer(), kd.DistributeCallback(distribution)],
    )
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--device-memory", default="1GiB", help='a size, or "engine" on GPUs/TPUs'
    )
    parser.add_argument("--race", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    arguments = parser.parse_args()
    # "engine": the limit the devices report (a GPU's or a TPU's; CPUs
    # report none and need a size).
    engine = arguments.device_memory == "engine"
    memory = None if engine else parse_memory(arguments.device_memory)
    model_function = build(arguments.layers, arguments.width)
    began = time.perf_counter()
    choice = plan_auto(
        model_function,
        batch_size=arguments.batch,
        auto=kd.Auto(memory, cache_dir=None),
    )
    result = {
        "model": f"{arguments.layers} x Dense({arguments.width}), Adam",
        "parameters": arguments.layers * (arguments.width**2 + arguments.width),
        "devices": len(kd.list_devices()),
        "device_memory": memory,
        "batch": arguments.batch,
        "search_seconds": round(time.perf_counter() - began, 2),
        "candidates_with_a_verdict": choice.searched,
        "chosen": choice.description,
        "line": choice.line,
    }
    if arguments.race:
        rows = arguments.batch * (arguments.steps + 1)
        x = np.random.RandomState(0).rand(rows, arguments.width).astype("float32")
        y = np.random.RandomState(1).rand(rows, arguments.width).astype("float32")
        devices = result["devices"]
        made = model_function()
        hand_picked = [
            Candidate("data_parallel", {"batch": devices}),
            Candidate("fsdp", {"batch": devices}),
        ] + [
            Candidate("fsdp_tp", {"batch": devices // size, "model": size})
            for size in model_axis_sizes(made, devices)
        ]
        timed = {}
        for candidate in hand_picked:
            timed[candidate.description] = step_ms(
                model_function, candidate, x, y, arguments.batch, arguments.steps
            )
        chosen = timed.get(choice.description)
        if chosen is None:
            chosen = step_ms(
                model_function,
                choice.candidate,
                x,
                y,
                arguments.batch,
                arguments.steps,
            )
        best = min(timed, key=timed.get)
        result.update(
            step_ms={name: round(ms, 2) for name, ms in timed.items()},
            chosen_step_ms=round(chosen, 2),
            best_hand_picked=best,
            ratio=round(chosen / timed[best], 3),
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
