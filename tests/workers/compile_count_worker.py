"""Counts JAX's compilations over a run of Keras calls, in a fresh process.

Usage: python compile_count_worker.py SCENARIO[,SCENARIO...] CANDIDATE OUTPUT_JSON

CANDIDATE is `plain` (Keras with no distribution) or `keras_dist`; SCENARIO
one of `SCENARIOS` (`KERAS_DIST_CPU_DEVICES` sets the devices); several run
one after the other, each from a cleared Keras session and emptied JAX caches,
counted on their own (one start-up). The calls:
`fit` of 3 epochs with validation data, `fit` again, `evaluate`, `predict`,
`fit` again, `predict` again. Every compilation XLA makes in them is counted
through `jax.monitoring` (its backend-compile event, named by the function),
so that a recompilation at an epoch's start, between two calls or after
`evaluate` shows. Writes the counts by function name, per scenario.
"""

from __future__ import annotations

import collections
import json
import sys

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import jax
import keras
import numpy as np

COMPILES: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **kwargs: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[str(kwargs.get("fun_name", ""))] += 1


# Each scenario: rows of data, BatchNormalization, steps_per_execution, and the
# distribution (None for the plain candidate).
SCENARIOS = {
    # One device: the mesh of one chip (Keras keeps an array on that device as
    # it is; keras_dist puts every value of the state on the mesh).
    "one_device": {"rows": 256, "batch_norm": False, "steps": 1},
    # 8 devices, an uneven last batch (padded and masked) and BatchNormalization.
    "uneven_batch_norm": {"rows": 100, "batch_norm": True, "steps": 1},
    "steps_per_execution": {"rows": 256, "batch_norm": False, "steps": 4},
    # Split variables: relaid out once when the run starts.
    "fsdp": {"rows": 256, "batch_norm": False, "steps": 1},
}


def build(batch_norm: bool, steps: int) -> keras.Model:
    keras.utils.set_random_seed(3)
    layers = [keras.Input((16,)), keras.layers.Dense(32, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dropout(0.1), keras.layers.Dense(8)]
    model = keras.Sequential(layers)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps,
    )
    return model


def main() -> None:
    scenarios, candidate, output = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    jax.monitoring.register_event_duration_secs_listener(_listen)
    results = {}
    for scenario in scenarios:
        # Each scenario as in a process of its own: a cleared Keras session,
        # no program compiled (JAX's in-memory caches emptied), none counted.
        keras.backend.clear_session()
        jax.clear_caches()
        COMPILES.clear()
        results[scenario] = run(scenario, candidate)
    with open(output, "w") as file:
        json.dump(results, file)


def run(scenario: str, candidate: str) -> dict:
    settings = SCENARIOS[scenario]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(settings["rows"], 16)).astype("float32")
    y = rng.integers(0, 8, size=(settings["rows"],)).astype("int32")
    model = build(settings["batch_norm"], settings["steps"])
    callbacks: list = []
    if candidate == "keras_dist":
        distribution = kd.FSDP(min_size=0) if scenario == "fsdp" else kd.DataParallel()
        callbacks = [kd.DistributeCallback(distribution)]
    before = sum(COMPILES.values())
    fit = {"batch_size": 32, "verbose": 0, "callbacks": callbacks}
    model.fit(x, y, epochs=3, validation_data=(x[:64], y[:64]), **fit)
    model.fit(x, y, epochs=2, **fit)
    model.evaluate(x, y, **fit)
    model.predict(x, **fit)
    model.fit(x, y, epochs=1, **fit)
    predictions = model.predict(x, **fit)
    return {
        "devices": jax.device_count(),
        "compiles": dict(COMPILES),
        "before_calls": before,
        "rows_predicted": int(predictions.shape[0]),
    }


if __name__ == "__main__":
    main()
