"""JAX FSDP: keras_dist's `kd.FSDP` against Keras' own `ModelParallel` laid out alike.

All candidates train the same MLP (`benchmarks/mlp.py`, built from the same
seed) on the same synthetic data with the same global batch, on N simulated
CPU devices (N = `KERAS_DIST_CPU_DEVICES`: 8, 4 or 2, one process per N):

- `keras_dist_fsdp`: the model is built with no distribution, then each `fit`
  gets `kd.DistributeCallback(kd.FSDP(min_size=MIN_SIZE))`: every variable of
  at least `MIN_SIZE` elements is split N ways along the data axis, and so
  are its Adam moments and gradients.
- `keras_dist_dp`: the same with `kd.DataParallel()`: everything replicated,
  the per-device memory FSDP is measured against.
- `native`: Keras' own `keras.distribution.ModelParallel` over the same 1-D
  mesh, with a `LayoutMap` that gives every variable the layout `kd.FSDP`
  gives it (one exact-path key per variable), made current *before* the model
  is built, as Keras requires. Keras gives each Adam moment the layout of its
  variable, and splits batches along the same axis, so this is the same
  sharded program written by hand with Keras' public API; the step-time
  ratio then measures what keras_dist adds, not Keras' `fit` loop.

Memory: after a short fit per candidate (outside the timing), the bytes that
each device holds of the model's weights and the optimizer's variables, read
from the live arrays' `addressable_shards`. FSDP should hold 1/N of the
replicated figure; what stays replicated (too small, integer, or no dimension
that N divides) is listed.

Run on its own (the runner sets the environment for you):

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=4 PYTHONPATH=. \
    python benchmarks/entries/jax_fsdp.py --repeats 3
```
"""

from __future__ import annotations

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import re
from collections import defaultdict
from typing import Any

import jax
import keras

from benchmarks.harness import (
    Candidate,
    StepTimer,
    compare_memory,
    devices_holding,
    entry_arguments,
    report,
    run_interleaved,
)
from benchmarks.mlp import (
    CLASSES,
    FEATURES,
    GLOBAL_BATCH,
    HIDDEN,
    SEED,
    describe,
    fit_steps,
    synthetic_data,
)

# Splits every kernel and the 512-element biases; the 10-element head bias
# (and Adam's integer counters) stay replicated.
MIN_SIZE = 512
MEMORY_STEPS = 3


def build_model() -> keras.Model:
    """`benchmarks.mlp`'s MLP with named layers, so that every build has the
    same variable paths (Keras' `LayoutMap` matches paths)."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden_1"),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden_2"),
            keras.layers.Dense(CLASSES, name="logits"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def held_bytes(model: keras.Model) -> dict[str, Any]:
    """Bytes of weights and optimizer variables held per device, and the paths
    of the floating variables that are not split."""
    per_device: dict[str, int] = defaultdict(int)
    total = 0
    replicated = []
    for variable in [*model.weights, *model.optimizer.variables]:
        value = variable.value
        total += value.nbytes
        for shard in value.addressable_shards:
            per_device[str(shard.device)] += shard.data.nbytes
        if value.sharding.is_fully_replicated:
            replicated.append(f"{variable.path} {tuple(variable.shape)}")
    return {
        "per_device_bytes": dict(per_device),
        "max_device_bytes": max(per_device.values()),
        "total_bytes": total,
        "replicated": replicated,
    }


def native_layout_map(fsdp: kd.FSDP) -> keras.distribution.LayoutMap:
    """Keras' `LayoutMap` giving each variable of the MLP kd.FSDP's layout."""
    probe = build_model()  # no distribution: only paths, shapes and dtypes
    mesh = keras.distribution.DeviceMesh(
        (len(keras.distribution.list_devices()),),
        [fsdp.axis],
        keras.distribution.list_devices(),
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for variable in probe.weights:
        axes = tuple(fsdp.layout_for_variable(variable).axes)
        layout_map[f"^{re.escape(variable.path)}$"] = axes
    return layout_map


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    devices = jax.local_device_count("cpu")
    if devices < 2:
        raise RuntimeError(
            f"This entry needs at least 2 CPU devices; JAX has {devices}. Set "
            "KERAS_DIST_CPU_DEVICES (run.py does)."
        )
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    fsdp = kd.FSDP(min_size=MIN_SIZE)
    data_parallel = kd.DataParallel()
    fsdp_model = build_model()
    dp_model = build_model()
    native_distribution = keras.distribution.ModelParallel(
        layout_map=native_layout_map(fsdp), batch_dim_name=fsdp.axis
    )
    with native_distribution.scope():
        native_model = build_model()

    fit_fsdp = fit_steps(fsdp_model, x, y, lambda: [kd.DistributeCallback(fsdp)])
    fit_dp = fit_steps(dp_model, x, y, lambda: [kd.DistributeCallback(data_parallel)])
    fit_native_model = fit_steps(native_model, x, y)

    def fit_native(steps: int, callbacks: list) -> keras.callbacks.History:
        with native_distribution.scope():
            return fit_native_model(steps, callbacks)

    # Memory first: a short fit each, then the live arrays (keras_dist keeps
    # the variables where the distribution put them after the fit on JAX).
    memory = {}
    for name, fit, model in (
        ("keras_dist_fsdp", fit_fsdp, fsdp_model),
        ("keras_dist_dp", fit_dp, dp_model),
        ("native", fit_native, native_model),
    ):
        fit(MEMORY_STEPS, [StepTimer()])
        memory[name] = held_bytes(model)
    compare_memory(memory, devices)

    candidates = [
        Candidate(
            "keras_dist_fsdp",
            f"fit + kd.DistributeCallback(kd.FSDP(min_size={MIN_SIZE}))",
            fit_fsdp,
        ),
        Candidate(
            "keras_dist_dp", "fit + kd.DistributeCallback(kd.DataParallel())", fit_dp
        ),
        Candidate(
            "native",
            "keras.distribution.ModelParallel, same layouts, set before build",
            fit_native,
        ),
    ]
    timings = run_interleaved(
        candidates,
        repeats=args.repeats,
        steps=args.steps,
        skip_steps=args.skip_steps,
        warmup_steps=args.warmup_steps,
    )
    report(
        f"jax_fsdp ({devices} devices)",
        args,
        devices=devices,
        global_batch=GLOBAL_BATCH,
        model=describe(fsdp_model),
        baseline="native",
        memory=memory,
        devices_used={
            "keras_dist_fsdp": devices_holding(fsdp_model),
            "keras_dist_dp": devices_holding(dp_model),
            "native": devices_holding(native_model),
        },
        **timings,
    )


if __name__ == "__main__":
    main()
