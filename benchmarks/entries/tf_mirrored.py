"""TensorFlow data parallelism: keras_dist against a raw `MirroredStrategy` fit.

Both candidates train the same MLP, built from the same seed, on the same
synthetic data with the same global batch, on 4 logical CPU devices:

- `keras_dist`: the model is built and compiled with no strategy, then each
  `fit` gets `kd.DistributeCallback(kd.DataParallel(...))` (its variables are
  mirrored at the first `fit`).
- `native`: the model is built and compiled inside the scope of the same
  `tf.distribute.MirroredStrategy(devices)`, as tf.distribute requires, and
  trained with Keras' own `fit` (no keras_dist callback).

Run on its own (the runner sets the environment for you):

```shell
KERAS_BACKEND=tensorflow KERAS_DIST_CPU_DEVICES=4 PYTHONPATH=. \
    python benchmarks/entries/tf_mirrored.py --repeats 3
```
"""

from __future__ import annotations

import os

# keras_dist first: importing it creates the logical devices before TF starts.
import keras_dist as kd  # isort: skip
import keras_dist.backends  # isort: skip

import keras
import tensorflow as tf

from benchmarks.harness import (
    Candidate,
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

# The runner's KERAS_DIST_CPU_DEVICES (4 by default; `scaling.py` also runs
# other counts: one entry per count in `run.py`).
DEVICES = int(os.environ.get("KERAS_DIST_CPU_DEVICES") or 4)


def replicas_of(model: keras.Model) -> int:
    """On how many devices the model's first kernel is mirrored."""
    value = model.trainable_variables[0].value
    return len(getattr(value, "values", [value]))


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    devices = kd.list_devices("cpu")
    if len(devices) != DEVICES:
        raise RuntimeError(
            f"This entry needs {DEVICES} CPU devices; TensorFlow has "
            f"{len(devices)}. Set KERAS_DIST_CPU_DEVICES={DEVICES} (run.py does)."
        )
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    kd_model = build_model()  # no strategy: what keras_dist users do
    kd_distribution = kd.DataParallel(devices=devices)

    # The same `tf.distribute.MirroredStrategy(devices)` object for both: two
    # MirroredStrategy objects over the same devices in one process hand out
    # the same collective keys, and their all-reduces then abort ("Collective
    # instance ... expected type"). `kd_distribution.scope()` enters exactly
    # that strategy's scope; the native model then trains with Keras' own fit.
    strategy = kd.backends.get_adapter().strategy(kd_distribution)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    with strategy.scope():
        native_model = build_model()

    fit_kd = fit_steps(kd_model, x, y, lambda: [kd.DistributeCallback(kd_distribution)])
    fit_native = fit_steps(native_model, x, y)

    candidates = [
        Candidate(
            "keras_dist", "fit + kd.DistributeCallback(kd.DataParallel())", fit_kd
        ),
        Candidate(
            "native", "model built in MirroredStrategy.scope(), Keras fit", fit_native
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
        "tf_mirrored" if DEVICES == 4 else f"tf_mirrored_{DEVICES}",
        args,
        devices=DEVICES,
        global_batch=GLOBAL_BATCH,
        model=describe(kd_model),
        baseline="native",
        devices_used={
            "keras_dist": replicas_of(kd_model),
            "native": replicas_of(native_model),
        },
        **timings,
    )


if __name__ == "__main__":
    main()
