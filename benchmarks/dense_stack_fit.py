"""`fit` of N x Dense(WIDTH) (float32, Adam) under `kd.DataParallel(offload=...)`:
one configuration per process, one JSON line (`RESULT {...}`).

What the "On the chip" figures of `docs/memory.md` come from (a TPU v5e chip,
one process per line; an out-of-memory is reported in the line, not raised):

```shell
export KERAS_BACKEND=jax
python benchmarks/dense_stack_fit.py --layers 20 --offload none --steps 3
python benchmarks/dense_stack_fit.py --layers 20 --offload optimizer --steps 3
python benchmarks/dense_stack_fit.py --layers 44 --offload optimizer --steps 2
```

`ms_per_step`: the fastest epoch after the first over its steps (`verbose=0`);
`peak_gib`: the device's `peak_bytes_in_use` in the process (model build and
`fit` together); `slot_memory_kinds`: the memory kinds of the optimizer's
variables seen from a callback during `fit`. `--save PATH` writes the first
4096 values of every weight, to compare two runs' weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import keras
    import numpy as np

    import keras_dist as kd

    out: dict[str, Any] = {"config": vars(args)}
    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.width,))
    x = inputs
    for _ in range(args.layers):
        x = keras.layers.Dense(args.width)(x)
    model = keras.Model(inputs, x)
    model.compile(
        optimizer=keras.optimizers.Adam(
            1e-4, gradient_accumulation_steps=args.accumulation or None
        ),
        loss="mse",
    )
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    xs = rng.standard_normal((rows, args.width), dtype=np.float32)
    ys = 0.1 * rng.standard_normal((rows, args.width), dtype=np.float32)
    options = {}
    if args.offload != "none":
        options["offload"] = args.offload
    if args.state_dtype != "none":
        options["optimizer_state_dtype"] = args.state_dtype
    kinds: set[str] = set()

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            out.setdefault("epoch_s", []).append(time.perf_counter() - self.start)
            out.setdefault("loss", []).append(float(logs["loss"]))

        def on_train_batch_end(self, batch, logs=None):
            for variable in self.model.optimizer.variables:
                kinds.add(str(variable.value.sharding.memory_kind))

    model.fit(
        xs,
        ys,
        batch_size=args.batch,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel(**options)), Watch()],
    )
    steady = out["epoch_s"][1:] or out["epoch_s"]
    out["ms_per_step"] = 1000 * min(steady) / args.steps
    out["slot_memory_kinds"] = sorted(kinds)
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    out["params"] = int(model.count_params())
    if args.save:
        first = [w.reshape(-1)[:4096] for w in model.get_weights()]
        np.save(args.save, np.concatenate(first))
    return out


def main() -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--offload", default="none", choices=["none", "optimizer"])
    parser.add_argument("--state-dtype", default="none")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=0)
    parser.add_argument("--save", default="")
    args = parser.parse_args()
    try:
        out = run(args)
        out["ok"] = True
    except Exception as error:  # an out-of-memory is a result here
        out = {"config": vars(args), "ok": False}
        out["error"] = f"{type(error).__name__}: {str(error)[:600]}"
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
