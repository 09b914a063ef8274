"""Activation checkpointing (`remat="full"`): memory saved and step time paid.

Trains a deep residual MLP (`--blocks` blocks of `Dense(4 * width, gelu)` then
`Dense(width)` plus the block's input, a transformer's feed-forward half; Adam,
batch `--batch`) for a few steps under `kd.DataParallel()` or `kd.FSDP()`, with
and without `remat="full"` (each block recomputed in the backward pass, only
its input kept), and prints one JSON line per run:

- `backward_start_bytes` (PyTorch): what malloc holds when the backward
  starts, over what it held before the model was built (glibc's `mallinfo2`,
  exact): the weights, the optimizer and what the forward kept for the
  backward. Its difference between the two runs is the activation memory
  remat saves.
- `step_peak_bytes`: the peak resident memory of the steps after the first
  (reset when the first ends), over the resident memory before the build: on
  JAX the whole of the N simulated devices (one process), where XLA's buffers
  for the step are allocated.
- `xla_temp_bytes` (JAX): XLA's own figure for the temporary buffers of the
  compiled loss-and-gradient of one batch on one device (its memory analysis:
  exact, where the resident memory of XLA's CPU runtime hardly moves), with
  the layers' modes that remat gives them (`RematPlan`, what `fit` applies).
- `step_ms`: the median step time (after `--skip-steps`), for the cost.

`--compare` runs each policy without and with remat in its own process (on
PyTorch with `--processes N`, its own job of N processes under `keras-dist
launch`; the figures are then the largest of any process), `--repeats` times,
interleaved, and prints the medians and spreads of the savings and the
step-time ratio.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/remat_memory.py --compare --policies dp fsdp
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/remat_memory.py --compare
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/remat_memory.py --compare \
    --processes 2 --policies dp fsdp
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import json
import os
import statistics

import keras
import numpy as np

from benchmarks.fsdp_memory import (
    BackwardStart,
    StepPeak,
    allocated_bytes,
    resident_bytes,
)
from benchmarks.harness import StepTimer, run_in_own_job


class Block(keras.layers.Layer):
    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def call(self, inputs):
        return inputs + self.down(self.up(inputs))


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.width,))
    hidden = inputs
    for index in range(args.blocks):
        hidden = Block(args.width, name=f"block_{index}")(hidden)
    outputs = keras.layers.Dense(10, name="logits")(hidden)
    model = keras.Model(inputs, outputs, name="deep_mlp")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def xla_temp_bytes(model: keras.Model, x: np.ndarray, y: np.ndarray, remat) -> int:
    """XLA's temporary bytes for the loss and gradients of `x`, `y` on one
    device, the layers recomputing as `remat` (a mode name or None) says."""
    import jax

    from keras_dist.distribution.remat import RematPlan

    undo = RematPlan(model, keras.RematScope(mode=remat)).apply() if remat else None
    try:
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]
        optimizer = [v.value for v in model.optimizer.variables]

        def loss(trainable, non_trainable, x, y):
            value, _ = model.compute_loss_and_updates(
                trainable,
                non_trainable,
                metrics,
                x,
                y,
                None,
                training=True,
                optimizer_variables=optimizer,
            )
            return value

        compiled = (
            jax.jit(jax.grad(loss)).lower(trainable, non_trainable, x, y).compile()
        )
        return int(compiled.memory_analysis().temp_size_in_bytes)
    finally:
        if undo is not None:
            undo()


def run_once(args: argparse.Namespace) -> dict:
    if keras.backend.backend() == "torch":
        # Joins the job under `keras-dist launch` (--processes); alone otherwise.
        kd.initialize()
        import torch

        torch.set_num_threads(int(os.environ.get("REMAT_BENCH_THREADS", "2")))
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int32")
    before, allocated_before = resident_bytes(), allocated_bytes()
    remat = "full" if args.remat else None
    distribution = (
        kd.FSDP(min_size=1024, remat=remat)
        if args.policy == "fsdp"
        else kd.DataParallel(remat=remat)
    )
    model = build(args)
    backward = BackwardStart(model) if keras.backend.backend() == "torch" else None
    timer, peak = StepTimer(), StepPeak()
    model.fit(
        x,
        y,
        batch_size=args.batch,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), timer, peak],
    )
    temp = None
    if keras.backend.backend() == "jax":
        temp = xla_temp_bytes(model, x[: args.batch], y[: args.batch], remat)
    return {
        "xla_temp_bytes": temp,
        "backend": keras.backend.backend(),
        "devices": len(kd.list_devices()),
        "processes": kd.num_processes(),
        "policy": args.policy,
        "remat": remat,
        "params": model.count_params(),
        "backward_start_bytes": None
        if backward is None
        else backward.most - allocated_before,
        "step_peak_bytes": peak.peak - before,
        "step_ms": 1000 * statistics.median(timer.step_times(args.skip_steps)),
    }


def compare(args: argparse.Namespace) -> None:
    """Every policy without and with remat, each run in its own process,
    interleaved `--repeats` times; the medians and spreads."""
    runs: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(args.repeats):
        for policy in args.policies:
            for remat in (False, True):
                arguments = ["--policy", policy, "--blocks", str(args.blocks)]
                arguments += ["--width", str(args.width), "--batch", str(args.batch)]
                arguments += ["--steps", str(args.steps)]
                arguments += ["--skip-steps", str(args.skip_steps)]
                arguments += ["--remat"] if remat else []
                env = dict(os.environ)
                if args.processes > 1:
                    # Each process on its own core; every process prints.
                    env.setdefault("REMAT_BENCH_THREADS", "1")
                runs.setdefault((policy, remat), []).append(
                    run_in_own_job(
                        __file__,
                        arguments,
                        args.processes,
                        most=(
                            "backward_start_bytes",
                            "step_peak_bytes",
                            "xla_temp_bytes",
                        ),
                        env=env,
                    )
                )
    mib = 2**20
    for policy in args.policies:
        plain, remat = runs[(policy, False)], runs[(policy, True)]
        key = (
            "backward_start_bytes"
            if plain[0]["backward_start_bytes"] is not None
            else "xla_temp_bytes"
        )
        saved = [(a[key] - b[key]) / mib for a, b in zip(plain, remat, strict=True)]
        ratio = [b["step_ms"] / a["step_ms"] for a, b in zip(plain, remat, strict=True)]
        print(
            json.dumps(
                {
                    "backend": plain[0]["backend"],
                    "devices": plain[0]["devices"],
                    "policy": policy,
                    "params": plain[0]["params"],
                    "measure": key,
                    "without_remat_mib": statistics.median(r[key] / mib for r in plain),
                    "with_remat_mib": statistics.median(r[key] / mib for r in remat),
                    "saved_mib_median": statistics.median(saved),
                    "saved_mib_range": [min(saved), max(saved)],
                    "step_time_ratio_median": statistics.median(ratio),
                    "step_time_ratio_range": [min(ratio), max(ratio)],
                    "step_ms_without": statistics.median(r["step_ms"] for r in plain),
                    "step_peak_mib_without": statistics.median(
                        r["step_peak_bytes"] / mib for r in plain
                    ),
                    "step_peak_mib_with": statistics.median(
                        r["step_peak_bytes"] / mib for r in remat
                    ),
                    "processes": args.processes,
                    "runs": args.repeats,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("dp", "fsdp"), default="dp")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-steps", type=int, default=2)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--policies", nargs="+", default=["dp"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="with --compare on PyTorch: run each under `keras-dist launch` "
        "with this many processes (kd.FSDP shards over them)",
    )
    args = parser.parse_args()
    if args.compare:
        compare(args)
    else:
        print(json.dumps(run_once(args)), flush=True)


if __name__ == "__main__":
    main()
