"""Sharded mixed precision: memory and step time of `kd.FSDP(mixed_precision=)`.

Trains a small decoder (token embedding, `--layers` pre-norm transformer
blocks of `MultiHeadAttention` and a gelu feed-forward, logits over the
vocabulary; Adam) under `kd.FSDP()` four ways, each in its own process:

- `float32`: built and trained in float32;
- `keras_mixed`: built under Keras' `mixed_bfloat16` policy (the reference
  for what mixed precision costs and saves, Keras' own way);
- `policy`: built in float32, trained under
  `kd.FSDP(mixed_precision=kd.MixedPrecisionPolicy("bfloat16"))`;
- `policy_f32_reduce` (PyTorch): the same with `reduce_dtype="float32"`.

It prints one JSON line per run and, with `--compare`, the medians over
`--repeats` interleaved rounds:

- `step_ms`: the median step time after `--skip-steps`;
- `peak_bytes` (JAX on an accelerator): the device's `peak_bytes_in_use` plus
  `peak_bytes_reserved` (the runtime keeps a program's temporaries apart);
- `backward_start_bytes` (PyTorch): what malloc holds when the backward
  starts over what it held before the build (weights, optimizer state and
  what the forward kept: the activations), the largest of any process.

```shell
# JAX, every device of this host (the TPU v5e chip, or simulated CPU devices):
KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/mixed_precision.py --compare
# PyTorch, 2 processes:
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/mixed_precision.py --compare \
    --processes 2 --width 256 --layers 2 --sequence 64 --batch 16
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import json
import statistics

import keras
import numpy as np

from benchmarks.fsdp_memory import BackwardStart, allocated_bytes
from benchmarks.harness import StepTimer, run_in_own_job

VARIANTS = ("float32", "keras_mixed", "policy", "policy_f32_reduce")


class Block(keras.layers.Layer):
    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.norm_1 = keras.layers.LayerNormalization()
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.norm_2 = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def call(self, inputs):
        hidden = self.norm_1(inputs)
        inputs = inputs + self.attention(hidden, hidden, use_causal_mask=True)
        return inputs + self.down(self.up(self.norm_2(inputs)))


def build(args: argparse.Namespace, policy: str) -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        tokens = keras.Input((args.sequence,), dtype="int32")
        hidden = keras.layers.Embedding(args.vocabulary, args.width)(tokens)
        for index in range(args.layers):
            hidden = Block(args.width, args.heads, name=f"block_{index}")(hidden)
        logits = keras.layers.Dense(args.vocabulary, name="logits")(hidden)
        model = keras.Model(tokens, logits, name="decoder")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def distribution(variant: str) -> kd.FSDP:
    if variant == "policy":
        return kd.FSDP(mixed_precision=kd.MixedPrecisionPolicy("bfloat16"))
    if variant == "policy_f32_reduce":
        return kd.FSDP(
            mixed_precision=kd.MixedPrecisionPolicy("bfloat16", reduce_dtype="float32")
        )
    return kd.FSDP()


def run_once(args: argparse.Namespace) -> dict:
    backend = keras.backend.backend()
    if backend == "torch":
        kd.initialize()  # joins the job under `keras-dist launch`
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    x = rng.integers(0, args.vocabulary, size=(rows, args.sequence)).astype("int32")
    y = np.roll(x, -1, axis=1)
    allocated_before = allocated_bytes()
    model = build(
        args, "mixed_bfloat16" if args.variant == "keras_mixed" else "float32"
    )
    backward = BackwardStart(model) if backend == "torch" else None
    timer = StepTimer()
    model.fit(
        x,
        y,
        batch_size=args.batch,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution(args.variant)), timer],
    )
    peak = None
    if backend == "jax":
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if stats:
            peak = stats.get("peak_bytes_in_use", 0) + stats.get(
                "peak_bytes_reserved", 0
            )
    return {
        "variant": args.variant,
        "backend": backend,
        "device": str(kd.list_devices()[0]),
        "devices": len(kd.list_devices()),
        "processes": kd.num_processes(),
        "params": model.count_params(),
        "step_ms": 1000 * statistics.median(timer.step_times(args.skip_steps)),
        "peak_bytes": peak,
        "backward_start_bytes": None
        if backward is None
        else backward.most - allocated_before,
    }


def compare(args: argparse.Namespace) -> None:
    variants = [
        v
        for v in VARIANTS
        if v != "policy_f32_reduce" or keras.backend.backend() == "torch"
    ]
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        for variant in variants:
            arguments = ["--variant", variant]
            for name in ("width", "layers", "heads", "sequence", "vocabulary"):
                arguments += [f"--{name}", str(getattr(args, name))]
            arguments += ["--batch", str(args.batch), "--steps", str(args.steps)]
            arguments += ["--skip-steps", str(args.skip_steps)]
            runs[variant].append(
                run_in_own_job(
                    __file__,
                    arguments,
                    args.processes,
                    most=("backward_start_bytes",),
                )
            )
    mib = 2**20
    summary = {"params": runs["float32"][0]["params"], "rounds": args.repeats}
    summary["device"] = runs["float32"][0]["device"]
    summary["processes"] = args.processes
    for variant, results in runs.items():
        row = {"step_ms": statistics.median(r["step_ms"] for r in results)}
        for key in ("peak_bytes", "backward_start_bytes"):
            if results[0][key] is not None:
                row[key.replace("bytes", "mib")] = round(
                    statistics.median(r[key] for r in results) / mib, 1
                )
        ratios = [
            r["step_ms"] / f["step_ms"]
            for r, f in zip(results, runs["float32"], strict=True)
        ]
        row["step_time_vs_float32"] = round(statistics.median(ratios), 3)
        row["range_vs_float32"] = [round(min(ratios), 3), round(max(ratios), 3)]
        summary[variant] = row
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, default="float32")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--vocabulary", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-steps", type=int, default=3)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    if args.compare:
        compare(args)
    else:
        print(json.dumps(run_once(args)), flush=True)


if __name__ == "__main__":
    main()
