"""JAX on an accelerator: keras_dist's `fit` against plain Keras and Keras' own
`DataParallel` on the same device, in one command.

Three candidates train the same model on the same data, one after the other,
each in a fresh process (one process holds an accelerator at a time; a fresh
one makes the compile time what a user's first `fit` sees, and the device's
memory peak its own):

- `plain`: `model.fit` with no distribution (Keras on the default device).
- `keras_dp`: `keras.distribution.set_distribution(DataParallel())` before
  the model is built (the order Keras asks for), then `fit`.
- `keras_dist`: the model built with no distribution, `fit` with
  `kd.DistributeCallback(kd.DataParallel())`.

Models: `mlp` (4 x Dense(2048) on 2048 features, batch 1024) and
`transformer` (a 2-block encoder, d_model 512, 8 heads, sequence 128, vocab
8192, batch 64, a token-classification head). Each candidate runs every
configuration (float32 and `mixed_bfloat16`, `steps_per_execution` 1 and 16)
in its process: a `fit` of `--epochs` epochs of `--steps` steps each (shuffled
arrays, Adam, accuracy). For each configuration it reports:

- `ms_per_step`: the median over epochs 2.. of an epoch's wall time over its
  steps (Keras' own loop, `verbose=0`, no per-step callback: what a user's
  `fit` runs at);
- `compile_s`: the first epoch's wall time less a steady epoch's (tracing,
  lowering and XLA's compilation of everything the first epoch ran), and
  `xla_compile_s`, `step_compiles`: XLA's compile seconds and the number of
  compilations of the step function in the whole `fit` (`jax.monitoring`);
- `mfu`: the model's training FLOPs per step (`keras_dist.flops`) over the
  step time, over the device's dense peak (`keras_dist.common.accelerators`);
- `hbm_peak_gib`: the device's `peak_bytes_in_use` in the candidate's
  process so far (configurations run float32 first: the peak of a later
  one is at least the earlier ones').

With `--interleave ROUNDS`, one more process per model times the steps with
the candidates taking turns: for each configuration, ROUNDS rounds of every
candidate in turn, each a fresh model compiled there (`--interleaved-only`
skips the fresh processes). Its medians are the fairer comparison of step
times where the device bounds the step: the fresh processes' step times move
from process to process by more than the candidates differ (on the chip's
transformer, 0.5% against 0.1%).

With `--calls`, the first configuration also runs `evaluate`, `predict` and a
second `fit`, and counts the compilations of each step function over them.

```shell
python benchmarks/accelerator.py --json accelerator.json   # every model
python benchmarks/accelerator.py --models mlp --configs fp32:1 bf16:16
python benchmarks/accelerator.py --interleave 3 --interleaved-only
```

It runs wherever JAX runs; on a CPU its figures say nothing about an
accelerator (`benchmarks/README.md` holds the figures from a TPU v5e chip).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ("plain", "keras_dp", "keras_dist")
MODELS = ("mlp", "transformer")
CONFIGS = ("fp32:1", "fp32:16", "bf16:1", "bf16:16")
SEED = 1234


# -- the models -------------------------------------------------------------------
def build(model_name: str, steps_per_execution: int) -> Any:
    import keras

    keras.utils.set_random_seed(SEED)
    if model_name == "mlp":
        inputs = keras.Input((2048,))
        hidden = inputs
        for _ in range(4):
            hidden = keras.layers.Dense(2048, activation="relu")(hidden)
        outputs = keras.layers.Dense(10, dtype="float32")(hidden)
        model = keras.Model(inputs, outputs, name="mlp")
    else:
        model = _transformer(keras)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def _transformer(keras: Any) -> Any:
    vocab, length, width, heads = 8192, 128, 512, 8
    tokens = keras.Input((length,), dtype="int32")
    hidden = keras.layers.Embedding(vocab, width)(tokens)
    positions = keras.layers.Embedding(length, width)(
        keras.ops.arange(length, dtype="int32")
    )
    hidden = hidden + positions
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(
            hidden, hidden
        )
        hidden = keras.layers.LayerNormalization()(hidden + attended)
        widened = keras.layers.Dense(4 * width, activation="gelu")(hidden)
        hidden = keras.layers.LayerNormalization()(
            hidden + keras.layers.Dense(width)(widened)
        )
    logits = keras.layers.Dense(vocab, dtype="float32")(hidden)
    return keras.Model(tokens, logits, name="transformer")


def data(model_name: str, rows: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(SEED)
    if model_name == "mlp":
        x = rng.normal(size=(rows, 2048)).astype("float32")
        y = rng.integers(0, 10, size=(rows,)).astype("int32")
    else:
        x = rng.integers(0, 8192, size=(rows, 128)).astype("int32")
        y = rng.integers(0, 8192, size=(rows, 128)).astype("int32")
    return x, y


BATCH = {"mlp": 1024, "transformer": 64}
TOKENS = {"mlp": None, "transformer": 128}


# -- one candidate, in its own process -------------------------------------------
def _listen_to_compiles() -> list[tuple[str, float]]:
    import jax

    compiles: list[tuple[str, float]] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((str(kwargs.get("fun_name", "")), duration))

    jax.monitoring.register_event_duration_secs_listener(listen)
    return compiles


def _fit_once(
    args: argparse.Namespace,
    candidate: str,
    config: str,
    compiles: list[tuple[str, float]],
    calls: bool,
) -> dict[str, Any]:
    """One `fit` of `candidate` in `config`, measured (see the module's doc)."""
    import jax
    import keras

    import keras_dist as kd
    from keras_dist.common.accelerators import peak_flops_per_device
    from keras_dist.flops import count_flops

    device = jax.devices()[0]
    dtype, spe = config.split(":")
    keras.mixed_precision.set_global_policy(
        "mixed_bfloat16" if dtype == "bf16" else "float32"
    )
    batch = BATCH[args.model]
    x, y = data(args.model, args.steps * batch)
    callbacks: list[Any] = []
    if candidate == "keras_dp":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = build(args.model, int(spe))
    if candidate == "keras_dist":
        callbacks = [kd.DistributeCallback(kd.DataParallel())]
    timer = _EpochTimer()
    first_compile = len(compiles)
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=args.epochs,
        verbose=0,
        callbacks=[*callbacks, timer],
    )
    fit_compiles = compiles[first_compile:]
    steady = statistics.median(timer.epochs[1:])
    flops = count_flops(model, batch, tokens_per_sample=TOKENS[args.model]).training
    peak = peak_flops_per_device(
        device.device_kind if device.platform != "cpu" else "cpu",
        "bfloat16" if dtype == "bf16" else "float32",
    )
    step_s = steady / args.steps
    record = {
        "model": args.model,
        "candidate": candidate,
        "config": config,
        "device": device.device_kind,
        "ms_per_step": 1e3 * step_s,
        "epoch_s": timer.epochs,
        "compile_s": timer.epochs[0] - steady,
        "xla_compile_s": sum(seconds for _, seconds in fit_compiles),
        "step_compiles": sum("train_step" in name for name, _ in fit_compiles),
        "compiled": sorted({name for name, _ in fit_compiles}),
        "tflops_per_step": flops / 1e12,
        "mfu": flops / step_s / peak if peak else None,
        "hbm_peak_gib": _peak_gib(device),
    }
    if calls:
        before = len(compiles)
        model.evaluate(x, y, batch_size=batch, verbose=0, callbacks=callbacks)
        model.predict(x, batch_size=batch, verbose=0, callbacks=callbacks)
        model.fit(x, y, batch_size=batch, epochs=2, verbose=0, callbacks=callbacks)
        model.evaluate(x, y, batch_size=batch, verbose=0, callbacks=callbacks)
        after = compiles[before:]
        record["calls_compiles"] = {
            step: sum(step in name for name, _ in after)
            for step in ("train_step", "test_step", "predict_step")
        }
        record["calls_compiles"]["all"] = len(after)
    if candidate == "keras_dp":
        keras.distribution.set_distribution(None)
    del model
    return record


def run_candidate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration of one candidate, in this (fresh) process."""
    compiles = _listen_to_compiles()
    records = []
    for index, config in enumerate(args.configs):
        record = _fit_once(
            args, args.candidate, config, compiles, args.calls and index == 0
        )
        record["mode"] = "fresh"
        records.append(record)
        print(json.dumps(record), flush=True)
    return records


def run_interleaved(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Step times with the candidates taking turns in this one process: for
    each configuration, `--interleave` rounds of every candidate in turn.
    What one process' state (its memory, its threads, the device's clocks)
    adds to a step falls on every candidate alike; the fresh processes'
    step times differ from run to run by more than the candidates do on a
    device-bound model."""
    compiles = _listen_to_compiles()
    records = []
    for config in args.configs:
        for round_index in range(args.interleave):
            for candidate in args.candidates:
                record = _fit_once(args, candidate, config, compiles, calls=False)
                record["mode"] = "interleaved"
                record["round"] = round_index
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


class _EpochTimer:
    """Wall time of each epoch (a Keras callback with no per-batch hook, so
    Keras' loop stays asynchronous; each epoch ends with its logs read back,
    which waits for its last step)."""

    def __new__(cls) -> Any:
        import keras

        class EpochTimer(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.epochs: list[float] = []
                self._start = 0.0

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.epochs.append(time.perf_counter() - self._start)

        return EpochTimer()


def _peak_gib(device: Any) -> float | None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


# -- the driver -------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument(
        "--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES)
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--calls", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no further candidate after this many seconds",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time steps with the candidates taking turns in one process, "
        "ROUNDS rounds per configuration",
    )
    parser.add_argument(
        "--interleaved-only",
        action="store_true",
        help="skip the fresh processes (no compile times, HBM peaks per candidate)",
    )
    parser.add_argument("--candidate", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--interleaved-process", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for config in args.configs:
        dtype, _, spe = config.partition(":")
        if dtype not in ("fp32", "bf16") or not spe.isdigit() or int(spe) < 1:
            parser.error(
                f"--configs takes DTYPE:STEPS_PER_EXECUTION with DTYPE fp32 or "
                f"bf16, e.g. fp32:1 bf16:16. Received: {config!r}"
            )
    if args.epochs < 2:
        parser.error(f"--epochs must be at least 2. Received: {args.epochs}")
    if args.interleave < 0 or (args.interleaved_only and not args.interleave):
        parser.error(
            f"--interleave takes a number of rounds >= 1 (needed by "
            f"--interleaved-only). Received: --interleave {args.interleave}"
        )
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if args.candidate:
        run_candidate(args)
        return
    if args.interleaved_process:
        run_interleaved(args)
        return
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    env = dict(os.environ, KERAS_BACKEND="jax")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    runs: list[tuple[str, list[str]]] = []
    for model_name in args.models:
        if not args.interleaved_only:
            runs += [(model_name, ["--candidate", c]) for c in args.candidates]
        if args.interleave:
            runs.append(
                (
                    model_name,
                    [
                        "--interleaved-process",
                        "--interleave",
                        str(args.interleave),
                        "--candidates",
                        *args.candidates,
                    ],
                )
            )
    for model_name, what in runs:
        elapsed = time.perf_counter() - started
        label = f"{model_name}/{what[1] if what[0] == '--candidate' else 'interleaved'}"
        if args.budget_s is not None and elapsed > args.budget_s:
            print(f"budget spent ({elapsed:.0f} s): {label} not run", flush=True)
            continue
        command = [
            sys.executable,
            __file__,
            *what,
            "--model",
            model_name,
            "--steps",
            str(args.steps),
            "--epochs",
            str(args.epochs),
            "--configs",
            *args.configs,
            *(["--calls"] if args.calls else []),
        ]
        child_start = time.perf_counter()
        finished = subprocess.run(
            command, env=env, capture_output=True, text=True, check=False
        )
        for line in finished.stdout.splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        print(
            f"{label}: exit {finished.returncode} in "
            f"{time.perf_counter() - child_start:.0f} s",
            flush=True,
        )
        if finished.returncode:
            print(finished.stderr[-3000:], flush=True)
    _print_table([r for r in records if r["mode"] == "fresh"])
    _print_interleaved([r for r in records if r["mode"] == "interleaved"])
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


def _print_table(records: list[dict[str, Any]]) -> None:
    def find(model: str, candidate: str, config: str) -> dict[str, Any] | None:
        for record in records:
            if (record["model"], record["candidate"], record["config"]) == (
                model,
                candidate,
                config,
            ):
                return record
        return None

    header = (
        f"{'model':<12}{'config':<9}{'candidate':<12}{'ms/step':>9}{'compile s':>11}"
        f"{'xla s':>8}{'compiles':>9}{'MFU':>7}{'HBM GiB':>9}{'vs plain':>10}"
        f"{'vs keras_dp':>12}"
    )
    print(header)
    for record in records:
        plain = find(record["model"], "plain", record["config"])
        native = find(record["model"], "keras_dp", record["config"])
        mfu = record["mfu"]
        hbm = record["hbm_peak_gib"]
        print(
            f"{record['model']:<12}{record['config']:<9}{record['candidate']:<12}"
            f"{record['ms_per_step']:>9.3f}{record['compile_s']:>11.2f}"
            f"{record['xla_compile_s']:>8.2f}{record['step_compiles']:>9}"
            f"{'' if mfu is None else f'{mfu:.3f}':>7}"
            f"{'' if hbm is None else f'{hbm:.2f}':>9}"
            f"{_ratio(record, plain):>10}{_ratio(record, native):>12}"
        )
        if "calls_compiles" in record:
            print(f"    evaluate, predict, fit, evaluate: {record['calls_compiles']}")


def _print_interleaved(records: list[dict[str, Any]]) -> None:
    """Per model, configuration and candidate: each round's ms/step, their
    median and the medians' ratios to plain Keras' and Keras' DataParallel."""
    if not records:
        return
    medians: dict[tuple[str, str, str], float] = {}
    rounds: dict[tuple[str, str, str], list[float]] = {}
    for record in records:
        key = (record["model"], record["config"], record["candidate"])
        rounds.setdefault(key, []).append(record["ms_per_step"])
    for key, values in rounds.items():
        medians[key] = statistics.median(values)
    print("\ninterleaved in one process (ms/step of each round, median):")
    print(
        f"{'model':<12}{'config':<9}{'candidate':<12}{'median':>9}{'vs plain':>10}"
        f"{'vs keras_dp':>12}  rounds"
    )
    for (model, config, candidate), values in rounds.items():
        median = medians[(model, config, candidate)]
        ratios = []
        for other in ("plain", "keras_dp"):
            base = medians.get((model, config, other))
            ratios.append("" if base is None else f"{median / base:.3f}")
        print(
            f"{model:<12}{config:<9}{candidate:<12}{median:>9.3f}{ratios[0]:>10}"
            f"{ratios[1]:>12}  {' '.join(f'{v:.3f}' for v in values)}"
        )


def _ratio(record: dict[str, Any], other: dict[str, Any] | None) -> str:
    if other is None:
        return ""
    return f"{record['ms_per_step'] / other['ms_per_step']:.3f}"


if __name__ == "__main__":
    main()
