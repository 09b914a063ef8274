"""JAX data parallelism: keras_dist against Keras' own `DataParallel`.

Both candidates train the same MLP, built from the same seed, on the same
synthetic data with the same global batch, on 8 simulated CPU devices:

- `keras_dist`: the model is built with no distribution, then each `fit` gets
  `kd.DistributeCallback(kd.DataParallel())`.
- `native`: `keras.distribution.DataParallel()` is made current *before* the
  model is built (Keras requires that order) and stays current for every `fit`.

The callback activates the distribution for one `fit` and recompiles the step
each time, so steady-state step time is measured within a fit (see
`benchmarks/harness.py`); the per-fit cost shows as the first-step time.

Run on its own (the runner sets the environment for you):

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/entries/jax_data_parallel.py --repeats 3
```
"""

from __future__ import annotations

import os

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import jax
import keras

from benchmarks.harness import (
    Candidate,
    devices_holding,
    entry_arguments,
    report,
    run_interleaved,
)
from benchmarks.mlp import (
    GLOBAL_BATCH,
    build_model,
    describe,
    fit_steps,
    synthetic_data,
)

# The runner's KERAS_DIST_CPU_DEVICES (8 by default; `scaling.py` also runs
# other counts: one entry per count in `run.py`).
DEVICES = int(os.environ.get("KERAS_DIST_CPU_DEVICES") or 8)


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    present = jax.local_device_count("cpu")
    if present != DEVICES:
        raise RuntimeError(
            f"This entry needs {DEVICES} CPU devices; JAX has {present}. Set "
            f"KERAS_DIST_CPU_DEVICES={DEVICES} (run.py does)."
        )
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    # Built before any distribution exists: what keras_dist users do.
    kd_model = build_model()
    kd_distribution = kd.DataParallel()

    native_distribution = keras.distribution.DataParallel()
    with native_distribution.scope():
        native_model = build_model()

    fit_kd = fit_steps(kd_model, x, y, lambda: [kd.DistributeCallback(kd_distribution)])
    fit_native_model = fit_steps(native_model, x, y)

    def fit_native(steps: int, callbacks: list) -> keras.callbacks.History:
        with native_distribution.scope():
            return fit_native_model(steps, callbacks)

    candidates = [
        Candidate(
            "keras_dist", "fit + kd.DistributeCallback(kd.DataParallel())", fit_kd
        ),
        Candidate(
            "native", "keras.distribution.DataParallel() set before build", fit_native
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
        "jax_data_parallel" if DEVICES == 8 else f"jax_data_parallel_{DEVICES}",
        args,
        devices=DEVICES,
        global_batch=GLOBAL_BATCH,
        model=describe(kd_model),
        baseline="native",
        devices_used={
            "keras_dist": devices_holding(kd_model),
            "native": devices_holding(native_model),
        },
        **timings,
    )


if __name__ == "__main__":
    main()
