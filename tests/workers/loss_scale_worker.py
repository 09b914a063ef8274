"""Mixed precision (`mixed_float16`): a float16 overflow in the gradients of
replica 1 only, under `kd.DataParallel` over 2 replicas, and the reference it
must equal: plain Keras on one device with the same global batches.

Row HUGE_ROW of the first global batch is 1000 times larger than the others:
its float16 backward overflows, while the forward pass and the float32 loss
stay finite. Each replica (device or process) gets a contiguous half of every
global batch of BATCH rows, so that row reaches replica 1 only: replica 0's
own gradients are finite. Keras' `LossScaleOptimizer` must skip that step and
halve its loss scale on every replica, as it does on one device, then train on.

Imported by tests/test_mixed_precision.py (JAX and TensorFlow, one process,
2 simulated devices) and run as one rank of a 2-process PyTorch job by
`tests.multiprocess.run_job`:
Usage: python loss_scale_worker.py OUTPUT_JSON
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import keras
import numpy as np
import worker_seed

import keras_dist as kd

ROWS, BATCH, HUGE_ROW = 32, 16, 9  # rows 8..15 of each batch go to replica 1
STEPS = ROWS // BATCH


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = 0.1 * rng.normal(size=(ROWS, 5)).astype("float32")
    y = 0.1 * rng.normal(size=(ROWS, 1)).astype("float32")
    x[HUGE_ROW] *= 1000.0
    return x, y


def train(callbacks: tuple = ()) -> keras.Model:
    """One epoch of STEPS steps under the global policy `mixed_float16`."""
    worker_seed.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, name="hidden"),
            # A float32 output, so that the loss is float32 and finite: only
            # the float16 backward through "hidden" overflows.
            keras.layers.Dense(1, dtype="float32", name="out"),
        ],
        name="mixed",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model


def state(model: keras.Model) -> dict:
    """The weights and the loss-scaling optimizer's state."""
    optimizer = model.optimizer
    return {
        "weights": [
            np.asarray(w, "float64").ravel().tolist() for w in model.get_weights()
        ],
        "dynamic_scale": float(np.asarray(optimizer.dynamic_scale)),
        "step_counter": int(np.asarray(optimizer.step_counter)),
        "iterations": int(np.asarray(optimizer.iterations)),
    }


def run(distribution: Callable[[], kd.Distribution], callbacks: tuple = ()) -> dict:
    """Train under `distribution()` and on one device, in `mixed_float16`."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = train((kd.DistributeCallback(distribution()), *callbacks))
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        reference = train()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {"distributed": state(model), "one_device": state(reference)}


def main() -> None:
    kd.initialize()
    result = run(kd.DataParallel)
    result["process"] = kd.process_id()
    with open(sys.argv[-1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
