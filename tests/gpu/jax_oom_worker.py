"""A model too large for a GPU whose JAX memory is capped
(`XLA_PYTHON_CLIENT_MEM_FRACTION`, set before JAX starts), fitted under
`kd.DataParallel()`: the `kd.OutOfDeviceMemoryError`, the variants it says
fit, and the first of them run for real in the same process.

Usage: XLA_PYTHON_CLIENT_MEM_FRACTION=0.03 python jax_oom_worker.py OUTPUT_JSON
[--width W --layers L]. Writes one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402

# The variants the error compiles (keras_dist.planner.on_devices), as the
# options of kd.DataParallel that make each.
VARIANTS = {
    'remat="full"': {"remat": "full"},
    "offload='optimizer'": {"offload": "optimizer"},
    "optimizer_state_dtype='bfloat16'": {"optimizer_state_dtype": "bfloat16"},
}


def _model(width: int, layers: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    stack = [keras.Input((width,))]
    stack += [
        keras.layers.Dense(width, activation="relu", name=f"dense_{index}")
        for index in range(layers)
    ]
    stack.append(keras.layers.Dense(10, name="out"))
    model = keras.Sequential(stack)
    model.compile(optimizer="adam", loss="mse")
    return model


def _fit(model: keras.Model, width: int, batch: int, **options) -> None:
    x = np.zeros((batch * 2, width), "float32")
    y = np.zeros((batch * 2, 10), "float32")
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel(**options))],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    # 8 x Dense(6144): 302 M parameters, 1.2 GB of float32 weights, as much
    # in gradients and twice that in Adam's moments: about 4.8 GB a step.
    parser.add_argument("--width", type=int, default=6144)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    device = jax.devices()[0]
    result: dict = {
        "device_kind": device.device_kind,
        "bytes_limit": (device.memory_stats() or {}).get("bytes_limit"),
        "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "error": None,
    }
    model = _model(args.width, args.layers)
    result["parameters"] = int(model.count_params())
    try:
        _fit(model, args.width, args.batch)
    except kd.OutOfDeviceMemoryError as error:
        message = str(error)
        result["error"] = type(error).__name__
        result["cause"] = type(error.__cause__).__name__
        result["message"] = message[:6000]
        result["fitting_variants"] = [
            label
            for label in VARIANTS
            if re.search(rf"^\s*{re.escape(label)}: fits", message, re.M)
        ]
    del model
    gc.collect()
    jax.clear_caches()
    result["variant_ran"] = None
    for label in result.get("fitting_variants") or []:
        result["variant"] = label
        try:
            _fit(
                _model(args.width, args.layers),
                args.width,
                args.batch,
                **VARIANTS[label],
            )
            result["variant_ran"] = True
        except Exception as problem:  # reported: the suggestion did not fit
            result["variant_ran"] = False
            result["variant_error"] = f"{type(problem).__name__}: {problem}"[:2000]
        stats = device.memory_stats() or {}
        result["variant_peak_bytes"] = stats.get("peak_bytes_in_use")
        break
    with open(args.output, "w") as file:
        json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
