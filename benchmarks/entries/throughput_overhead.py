"""The cost of `kd.callbacks.Throughput`: the same fit with and without it.

Both candidates train the same model object (`mlp.py`'s MLP, global batch
512) on the same data, on 8 simulated CPU devices, each `fit` under
`kd.DistributeCallback(kd.DataParallel())`:

- `throughput`: with `kd.callbacks.Throughput(512, verbose=0)` too;
- `plain`: without it (the baseline).

The harness' `StepTimer` is in both, so both run Keras' synchronous batch
ends, as any fit with a progress bar (`verbose=1` or `2`) does: the ratio is
what the callback's own work (two clock reads per step, the timed batch
reads, the FLOP count and the figures at the end of each epoch) adds.
Target: at most 1.01.

`Throughput` also makes Keras hand each step's logs over synchronously,
which a fit with `verbose=0` and no per-batch callback would read on a
background thread. The entry measures that cost too, outside the table
(`async_cost` in the JSON): whole fits of the same model on one device (no
distribution: the asynchronous plain fit can stall on simulated devices, see
the README), `verbose=0`, with no callback against with `Throughput` only,
interleaved, as the ratio of median fit times.

Run on its own (the runner sets the environment for you):

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/entries/throughput_overhead.py --repeats 3
```
"""

from __future__ import annotations

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import statistics
import time

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
from keras_dist.callbacks import Throughput
from keras_dist.keras_compat.epoch_iterator import timed_reads

DEVICES = 8


class DevicesHolding(keras.callbacks.Callback):
    """Records on how many devices the weights are once the fit started."""

    def __init__(self, record: dict, name: str) -> None:
        super().__init__()
        self.record, self.name = record, name

    def on_train_begin(self, logs=None):
        self.record[self.name] = devices_holding(self.model)


def hook_cost(model: keras.Model, steps: int = 20_000) -> dict:
    """Microseconds per step that the callback's own per-step work takes,
    driven directly, without a fit (so without the machine's noise): its two
    batch hooks and the timed read of a batch, less the same loop with a
    plain iterator and no callback."""
    callback = Throughput(GLOBAL_BATCH, verbose=0)
    callback.set_model(model)
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)
    callback.on_train_batch_end(0, {})  # the one-off FLOP count
    # What fit reads its batches through while the callback runs.
    timed = timed_reads(iter(range(steps)))
    start = time.perf_counter()
    for step in range(steps):
        next(timed)
        callback.on_train_batch_begin(step)
        callback.on_train_batch_end(step, {})
    hooked = time.perf_counter() - start
    plain = iter(range(steps))
    start = time.perf_counter()
    for _ in range(steps):
        next(plain)
    bare = time.perf_counter() - start
    start = time.perf_counter()
    callback.on_epoch_end(0, {})
    epoch_end = time.perf_counter() - start
    callback.on_train_end()
    return {
        "per_step_us": (hooked - bare) / steps * 1e6,
        "epoch_end_ms": epoch_end * 1e3,
    }


def async_cost(steps: int, repeats: int) -> dict:
    """Median whole-fit seconds, one device, verbose=0: no callback at all
    (Keras reads the logs on a background thread) against `Throughput` only."""
    x, y = synthetic_data(steps * GLOBAL_BATCH)
    model = build_model()
    runs = {"no_callback": [], "throughput": []}
    for repeat in range(repeats + 1):  # the first round compiles
        for name in runs:
            callbacks = (
                [Throughput(GLOBAL_BATCH, verbose=0)] if name != "no_callback" else []
            )
            start = time.perf_counter()
            model.fit(
                x,
                y,
                batch_size=GLOBAL_BATCH,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            if repeat:
                runs[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    return {
        "fit_s": runs,
        "median_fit_s": medians,
        "ratio": medians["throughput"] / medians["no_callback"],
    }


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    present = jax.local_device_count("cpu")
    if present != DEVICES:
        raise RuntimeError(
            f"This entry needs {DEVICES} CPU devices; JAX has {present}. Set "
            f"KERAS_DIST_CPU_DEVICES={DEVICES} (run.py does)."
        )
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)
    model = build_model()
    distribution = kd.DataParallel()

    devices_used: dict[str, int] = {}

    def with_throughput() -> list:
        return [
            kd.DistributeCallback(distribution),
            Throughput(GLOBAL_BATCH, verbose=0),
            DevicesHolding(devices_used, "throughput"),
        ]

    def without() -> list:
        return [
            kd.DistributeCallback(distribution),
            DevicesHolding(devices_used, "plain"),
        ]

    candidates = [
        Candidate(
            "throughput",
            "DataParallel fit + kd.callbacks.Throughput",
            fit_steps(model, x, y, with_throughput),
        ),
        Candidate(
            "plain",
            "the same fit without it",
            fit_steps(model, x, y, without),
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
        "throughput_overhead",
        args,
        devices=DEVICES,
        global_batch=GLOBAL_BATCH,
        model=describe(model),
        baseline="plain",
        devices_used=devices_used,
        async_cost=async_cost(args.steps, args.repeats),
        hook_cost=hook_cost(model),
        **timings,
    )


if __name__ == "__main__":
    main()
