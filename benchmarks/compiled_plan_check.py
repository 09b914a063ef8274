"""The compiled plan against the real `fit` on the chip it plans for.

For each model and precision, in a process of its own (so that the chip's
peak memory is that model's): `kd.plan(..., topology=...)` compiles fit's
train step for the chip's own topology (`v5e:1x1` for one v5e chip) on
abstract values; then the same model trains for real under
`kd.DistributeCallback(kd.DataParallel())` and the chip says its peak
memory (`memory_stats()`: `peak_bytes_in_use`, the buffers, plus
`peak_bytes_reserved`, the programs' temporaries) and the step time. Each
record also has the static plan's total of the same call (`static_bytes`:
parameters, gradients, optimizer slots and the activations' estimate) and the
memory term the roofline would have from XLA's bytes accessed instead of the
bytes that must cross HBM (`bytes_accessed_ms`). The models: the MLP and the
transformer of `benchmarks/accelerator.py`, a KerasHub Gemma decoder from a
config, and a causal decoder of 4 `benchmarks/mixed_precision.py` blocks. Run with
`--plan-only` on a CPU host with libtpu (`pip install "keras-dist[tpu]"`) to
compile the same plans there: the memory figures must be the same.

    # on the chip (all cases, JSON lines to compiled_plan.jsonl):
    KERAS_BACKEND=jax python benchmarks/compiled_plan_check.py --json chip.jsonl
    # on a CPU host, the plans alone:
    KERAS_BACKEND=jax python benchmarks/compiled_plan_check.py --plan-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MODELS = ("mlp", "transformer", "gemma", "decoder")
PRECISIONS = ("fp32", "bf16")
GEMMA = {
    "vocabulary_size": 8192,
    "num_layers": 2,
    "num_query_heads": 4,
    "num_key_value_heads": 1,
    "hidden_dim": 512,
    "intermediate_dim": 2048,
    "head_dim": 128,
}
GEMMA_BATCH, GEMMA_LENGTH = 32, 128
# A causal decoder of 4 pre-norm blocks (`benchmarks/mixed_precision.py`'s).
DECODER = {"width": 512, "heads": 8, "layers": 4, "vocabulary": 8192}
DECODER_BATCH, DECODER_LENGTH = 16, 256


def build(name: str) -> Any:
    import keras

    if name == "decoder":
        return _decoder()
    if name != "gemma":
        from benchmarks.accelerator import build as build_benchmark

        return build_benchmark(name, 1)
    import keras_hub

    keras.utils.set_random_seed(1234)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _decoder() -> Any:
    import keras

    from benchmarks.mixed_precision import Block

    keras.utils.set_random_seed(1234)
    tokens = keras.Input((DECODER_LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(DECODER["vocabulary"], DECODER["width"])(tokens)
    for index in range(DECODER["layers"]):
        hidden = Block(DECODER["width"], DECODER["heads"], name=f"block_{index}")(
            hidden
        )
    logits = keras.layers.Dense(DECODER["vocabulary"], dtype="float32")(hidden)
    model = keras.Model(tokens, logits, name="decoder")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(name: str, rows: int) -> tuple[Any, Any]:
    import numpy as np

    if name == "decoder":
        rng = np.random.default_rng(1234)
        tokens = rng.integers(0, DECODER["vocabulary"], (rows, DECODER_LENGTH + 1))
        return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    if name != "gemma":
        from benchmarks.accelerator import data as benchmark_data

        return benchmark_data(name, rows)
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, GEMMA["vocabulary_size"], (rows, GEMMA_LENGTH + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((rows, GEMMA_LENGTH), "int32"),
    }
    return x, tokens[:, 1:].astype("int32")


def batch_of(name: str) -> int:
    from benchmarks.accelerator import BATCH

    if name == "decoder":
        return DECODER_BATCH
    return GEMMA_BATCH if name == "gemma" else BATCH[name]


def run_case(name: str, precision: str, topology: str, plan_only: bool) -> dict:
    import keras

    import keras_dist as kd

    if precision == "bf16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    batch = batch_of(name)
    started = time.perf_counter()
    planned = kd.plan(
        lambda: build(name),
        kd.DataParallel,
        topology=topology,
        batch_size=batch,
        sequence_length=GEMMA_LENGTH if name == "gemma" else None,
        steps=("train",),
    )
    train = planned.compiled.steps["train"]
    # The static plan of the same call (shapes and estimates, no compile):
    # parameters, gradients, optimizer slots and the activations' estimate.
    static = planned.devices[0]
    record = {
        "model": name,
        "precision": precision,
        "topology": topology,
        "plan_seconds": round(time.perf_counter() - started, 1),
        "plan_peak_bytes": train.peak_bytes,
        "plan_argument_bytes": train.argument_bytes,
        "plan_temp_bytes": train.temp_bytes,
        "plan_flops": train.flops,
        "plan_step_ms": None
        if train.step_seconds is None
        else train.step_seconds * 1e3,
        "plan_seconds_by_bound": train.seconds,
        # The memory term counted the old way, from XLA's bytes accessed
        # (every operation's operands and results, as if unfused).
        "bytes_accessed_ms": _bytes_accessed_ms(train, planned.compiled.device_kind),
        "plan_device_traffic_bytes": train.device_traffic_bytes,
        "plan_error": train.error,
        "static_bytes": static.total,
        "static_parts": {
            "parameters": static.parameters,
            "gradients": static.gradients,
            "optimizer_slots": static.optimizer_slots,
            "activations": static.activations,
        },
    }
    if plan_only:
        return record
    import jax

    model = build(name)
    steps = 40
    x, y = data(name, batch * steps)
    times: list[float] = []

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index: int, logs: Any = None) -> None:
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch_index: int, logs: Any = None) -> None:
            jax.block_until_ready(self.model.trainable_variables[0].value)
            times.append(time.perf_counter() - self.began)

    # Keras' own fit (a KerasHub task's fit would want tf.data or grain to
    # preprocess; its preprocessor is None here).
    keras.Model.fit(
        model,
        x,
        y,
        batch_size=batch,
        epochs=2,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel()), StepTimes()],
    )
    steady = sorted(times[steps + 5 :])
    stats = jax.devices()[0].memory_stats() or {}
    record.update(
        # The runtime keeps a program's temporaries in a reservation of its
        # own, apart from the buffers `peak_bytes_in_use` counts.
        measured_peak_bytes=stats.get("peak_bytes_in_use", 0)
        + stats.get("peak_bytes_reserved", 0),
        memory_stats={k: v for k, v in stats.items() if "bytes" in k},
        measured_step_ms=steady[len(steady) // 2] * 1e3,
        device_kind=jax.devices()[0].device_kind,
    )
    if record["measured_peak_bytes"] and record["plan_peak_bytes"]:
        record["peak_ratio"] = record["plan_peak_bytes"] / record["measured_peak_bytes"]
    if record["plan_step_ms"]:
        record["step_ratio"] = record["plan_step_ms"] / record["measured_step_ms"]
    return record


def _bytes_accessed_ms(train: Any, device_kind: str) -> float | None:
    from keras_dist.common.accelerators import kind_of

    kind = kind_of(device_kind)
    if kind is None or not kind.memory_bandwidth or train.bytes_accessed is None:
        return None
    return train.bytes_accessed / kind.memory_bandwidth * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        name, precision = args.case.split(":")
        print(json.dumps(run_case(name, precision, args.topology, args.plan_only)))
        return
    records = []
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            command = [sys.executable, __file__, "--case", f"{name}:{precision}"]
            command += ["--topology", args.topology]
            command += ["--plan-only"] if args.plan_only else []
            done = subprocess.run(
                command, capture_output=True, text=True, env=os.environ, check=False
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(f"{name}:{precision} failed:\n{done.stderr[-3000:]}")
                continue
            record = json.loads(lines[-1])
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(record) + "\n")
    _print_table(records)


def _print_table(records: list[dict]) -> None:
    print(
        "| model | precision | static MiB | plan peak MiB | measured peak MiB "
        "| plan / measured | projected ms | measured ms | projected / measured "
        "| bytes-accessed ms | plan s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:

        def mib(value: Any) -> str:
            return "" if value is None else f"{value / 2**20:.1f}"

        print(
            f"| {r['model']} | {r['precision']} | {mib(r.get('static_bytes'))} | "
            f"{mib(r['plan_peak_bytes'])} | "
            f"{mib(r.get('measured_peak_bytes'))} | {r.get('peak_ratio', 0):.3f} | "
            f"{(r['plan_step_ms'] or 0):.3f} | {r.get('measured_step_ms', 0):.3f} | "
            f"{r.get('step_ratio', 0):.3f} | {(r.get('bytes_accessed_ms') or 0):.3f} "
            f"| {r['plan_seconds']} |"
        )


if __name__ == "__main__":
    main()
