"""Context parallelism (`sequence_axis=`): each device's activation memory and
the step's cost, on JAX.

A small decoder (an `Embedding`, 2 blocks of `MultiHeadAttention` with a
causal mask and a gelu MLP, each with its residual and `LayerNormalization`,
a `Dense` head over the vocabulary; Adam, sparse cross-entropy) is trained by
`fit` on 8 simulated CPU devices, three ways:

- `kd.FSDP()` on a mesh `("batch",) = (8,)`: each device holds whole
  sequences;
- `kd.FSDP(mesh, sequence_axis="seq")` on `("batch", "seq") = (1, 8)` and
  `(2, 4)`: each sequence split in 8 or 4 chunks.

**Memory.** For each `--lengths` sequence length, fit's own train step is
compiled (`kd.plan(..., topology="cpu:8")`: the step Keras jits, with
keras_dist's layouts and attention split, on abstract values) and XLA's
memory analysis of the compiled program gives, per device, its temporaries
(activations, their gradients, the attention scores) and its peak
(arguments + outputs + temporaries + code, less what is donated). Two
batches: one sequence for each batch shard (8, 1 and 2 sequences: what each
device must hold for a sequence of that length), and the same global batch
of 8 for all (the same tokens a device).

**Time.** `fit` of a few steps of a global batch of 8 at the `--time-lengths`
lengths, the three ways in turns (`benchmarks/harness.py`); the ratio to
`kd.FSDP()` on `(8,)` is indicative only on a shared CPU.

**An axis of size 1** (`--axis-one`, or as part of the default run): the
same decoder under `kd.DataParallel(mesh, sequence_axis="seq")` on a mesh
`("batch", "seq") = (N, 1)` against `kd.DataParallel()` on `(N,)`, Keras'
own `keras.distribution.DataParallel()` and, on one device, plain Keras
(no distribution): step time in turns and, on CPU devices, whether the
compiled train steps are the same program (their HLO after XLA's
optimisations, source locations left out) and the same peak bytes. On an
accelerator `--axis-one` trains a larger decoder by default (width 1024, 8
heads, vocabulary 16384, sequences of 1024 tokens, global batch 8).

```shell
PYTHONPATH=. python benchmarks/context_parallel.py            # 8 CPU devices
PYTHONPATH=. python benchmarks/context_parallel.py --quick    # a minute or two
python benchmarks/context_parallel.py --axis-one              # e.g. one TPU chip
```

Prints Markdown tables (and `--json PATH` writes the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEVICES = 8
#: (label, mesh, sequence axis) of the memory and time comparisons.
LAYOUTS = (
    ("kd.FSDP() on (8,)", {"batch": 8}, None),
    ('kd.FSDP(sequence_axis="seq") on (1, 8)', {"batch": 1, "seq": 8}, "seq"),
    ('kd.FSDP(sequence_axis="seq") on (2, 4)', {"batch": 2, "seq": 4}, "seq"),
)
MIB = 2**20
#: The mesh a module was partitioned for, named on its first line, and the
#: layout of each argument in that mesh's axis names (the `sharding=` beside
#: it says where its pieces are).
MESH_ATTRIBUTE = r",? ?frontend_attributes=\{xla\.sdy\.meshes=\{[^}]*\}\}"
AXIS_NAMES = r', frontend_attributes=\{xla\.sdy\.sharding="(?:[^"\\]|\\.)*"\}'


# -- the model -------------------------------------------------------------------
def build_decoder(args: argparse.Namespace, sequence: int) -> Any:
    """The decoder for sequences of `sequence` tokens, compiled."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((sequence,), dtype="int32", name="token_ids")
    hidden = keras.layers.Embedding(args.vocabulary, args.width, name="embedding")(
        tokens
    )
    for index in range(args.blocks):
        attended = keras.layers.MultiHeadAttention(
            args.heads, args.width // args.heads, name=f"attention_{index}"
        )(hidden, hidden, use_causal_mask=True)
        hidden = keras.layers.LayerNormalization(name=f"norm_{index}_a")(
            hidden + attended
        )
        up = keras.layers.Dense(4 * args.width, "gelu", name=f"up_{index}")(hidden)
        down = keras.layers.Dense(args.width, name=f"down_{index}")(up)
        hidden = keras.layers.LayerNormalization(name=f"norm_{index}_b")(hidden + down)
    logits = keras.layers.Dense(args.vocabulary, name="logits")(hidden)
    model = keras.Model(tokens, logits, name="decoder")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def token_data(args: argparse.Namespace, rows: int, sequence: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocabulary, (rows, sequence + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def describe(args: argparse.Namespace) -> str:
    model = build_decoder(args, 8)
    return (
        f"decoder: width {args.width}, {args.heads} heads, {args.blocks} blocks, "
        f"vocabulary {args.vocabulary}, {model.count_params():,} parameters, "
        "Adam, float32"
    )


# -- compiled steps ----------------------------------------------------------------
@contextlib.contextmanager
def recording_programs() -> Iterator[list[str]]:
    """The text of every program compiled through `jax.stages` (what
    `kd.plan(..., topology=)` compiles) while the block runs."""
    import jax

    texts: list[str] = []
    original = jax.stages.Lowered.compile

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = original(self, *args, **kwargs)
        texts.append(compiled.as_text())
        return compiled

    jax.stages.Lowered.compile = compile
    try:
        yield texts
    finally:
        jax.stages.Lowered.compile = original


def program_body(text: str) -> str:
    """An optimised HLO module's text without what names the Python source
    (its file, function and stack-frame tables and each instruction's
    `metadata`) or the mesh's axis names, its instructions and parameters
    renamed in order of appearance: two programs that compute the same way
    compare equal."""
    lines = text.splitlines()
    start = next(
        (
            number
            for number, line in enumerate(lines)
            if number and line.startswith(("%", "ENTRY"))
        ),
        1,
    )
    header = re.sub(MESH_ATTRIBUTE, "", lines[0])
    body = re.sub(r", metadata=\{[^{}]*\}", "", "\n".join(lines[start:]))
    body = re.sub(AXIS_NAMES, "", body)
    names: dict[str, str] = {}
    body = re.sub(
        r"%[\w.-]+|\bparam(?:\.\d+)?\b",
        lambda found: names.setdefault(found.group(0), f"%{len(names)}"),
        body,
    )
    return f"{header}\n{body}"


def compiled_train_step(
    args: argparse.Namespace,
    sequence: int,
    make: Callable[[Any], Any],
    mesh: dict[str, int],
    batch: int,
) -> dict[str, Any]:
    """XLA's per-device figures of fit's train step compiled for `mesh` on
    this process' CPU devices, and the step's program."""
    import keras_dist as kd

    started = time.perf_counter()
    with recording_programs() as texts:
        plan = kd.plan(
            lambda: build_decoder(args, sequence),
            make,
            topology=f"cpu:{math.prod(mesh.values())}",
            mesh=mesh,
            batch_size=batch,
            steps=("train",),
        )
    step = plan.compiled.steps["train"]
    if step.error:
        raise RuntimeError(f"XLA did not compile the step: {step.error}")
    programs = [text for text in texts if "train_step" in text.splitlines()[0]]
    return {
        "temp_bytes": step.temp_bytes,
        "peak_bytes": step.peak_bytes,
        "argument_bytes": step.argument_bytes,
        "flops": step.flops,
        "collective_bytes": dict(step.collective_bytes),
        "compile_s": round(time.perf_counter() - started, 1),
        "program": program_body(programs[-1]) if programs else None,
    }


def memory_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per-device temporaries and peak of the train step, each layout, each
    length, one sequence per batch shard and a global batch of 8."""
    import keras_dist as kd

    rows = []
    for sequence in args.lengths:
        baseline = None
        for batch_rule in ("one a batch shard", "8"):
            for label, mesh, axis in LAYOUTS:
                batch = mesh["batch"] if batch_rule == "one a batch shard" else 8
                if batch_rule == "8" and axis is None:
                    continue  # the same step as one a batch shard
                figures = compiled_train_step(
                    args,
                    sequence,
                    lambda device_mesh, axis=axis: kd.FSDP(
                        device_mesh, sequence_axis=axis
                    ),
                    mesh,
                    batch,
                )
                figures.pop("program")
                if axis is None:
                    baseline = figures
                shards = mesh.get("seq", 1)
                row = {
                    "sequence": sequence,
                    "layout": label,
                    "global_batch": batch,
                    "tokens_per_device": batch * sequence // DEVICES,
                    "chunk": sequence // shards,
                    **figures,
                    "temp_vs_fsdp": baseline["temp_bytes"] / figures["temp_bytes"],
                    "peak_vs_fsdp": baseline["peak_bytes"] / figures["peak_bytes"],
                }
                rows.append(row)
                log(
                    f"memory L={sequence} {label} batch {batch}: temp "
                    f"{row['temp_bytes'] / MIB:.1f} MiB, peak "
                    f"{row['peak_bytes'] / MIB:.1f} MiB ({row['compile_s']} s)"
                )
    return rows


# -- timed fits --------------------------------------------------------------------
def fitter(
    model: Any,
    data: tuple,
    batch: int,
    own_callbacks: Callable[[], list],
    scope: Callable[[], Any] = contextlib.nullcontext,
) -> Callable[[int, list], Any]:
    x, y = data

    def fit(steps: int, callbacks: list) -> Any:
        rows = steps * batch
        with scope():
            return model.fit(
                x[:rows],
                y[:rows],
                batch_size=batch,
                shuffle=False,
                verbose=0,
                callbacks=[*own_callbacks(), *callbacks],
            )

    return fit


def paired(
    timings: dict[str, Any], baseline: str
) -> dict[str, dict[str, float | list[float]]]:
    """Each candidate's median step (ms), the median and range of its
    per-repeat ratio to `baseline`'s, and its fastest step (ms) and that
    over `baseline`'s fastest (what a busy host's noise moves least)."""
    steps = {
        c["name"]: [r["median_step_s"] for r in c["repeats"]]
        for c in timings["candidates"]
    }
    fastest = {
        c["name"]: min(t for r in c["repeats"] for t in r["step_times_s"])
        for c in timings["candidates"]
    }
    result = {}
    for name, times in steps.items():
        ratios = [a / b for a, b in zip(times, steps[baseline], strict=True)]
        result[name] = {
            "ms_per_step": 1000 * statistics.median(times),
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "fastest_ms": 1000 * fastest[name],
            "fastest_ratio": fastest[name] / fastest[baseline],
        }
    return result


def time_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """ms/step of the three layouts at a global batch of 8, in turns."""
    import keras_dist as kd
    from benchmarks.harness import Candidate, run_interleaved

    rows = []
    batch = 8
    for sequence in args.time_lengths:
        data = token_data(args, batch * max(args.steps, args.warmup_steps), sequence)
        candidates = []
        for label, mesh, axis in LAYOUTS:
            device_mesh = kd.DeviceMesh(tuple(mesh.values()), list(mesh))
            distribution = kd.FSDP(device_mesh, sequence_axis=axis)
            model = build_decoder(args, sequence)
            candidates.append(
                Candidate(
                    label,
                    label,
                    fitter(
                        model,
                        data,
                        batch,
                        lambda d=distribution: [kd.DistributeCallback(d)],
                    ),
                )
            )
        timings = run_interleaved(
            candidates,
            repeats=args.repeats,
            steps=args.steps,
            skip_steps=args.skip_steps,
            warmup_steps=args.warmup_steps,
            log=log,
        )
        for label, figures in paired(timings, LAYOUTS[0][0]).items():
            rows.append({"sequence": sequence, "layout": label, **figures})
    return rows


# -- an axis of size 1 -------------------------------------------------------------
def axis_one(args: argparse.Namespace) -> dict[str, Any]:
    """`sequence_axis` on an axis of size 1 against the ways without it."""
    import jax
    import keras

    import keras_dist as kd
    from benchmarks.harness import Candidate, run_interleaved

    devices = len(jax.devices())
    sequence, batch = args.axis_one_length, args.axis_one_batch
    data = token_data(
        args, batch * max(args.axis_one_steps, args.warmup_steps), sequence
    )
    with_axis = kd.DataParallel(
        kd.DeviceMesh((devices, 1), ["batch", "seq"]), sequence_axis="seq"
    )
    without = kd.DataParallel()
    native = keras.distribution.DataParallel()
    with native.scope():
        native_model = build_decoder(args, sequence)
    candidates = [
        Candidate(
            "kd_dp",
            f"kd.DataParallel() on ({devices},)",
            fitter(
                build_decoder(args, sequence),
                data,
                batch,
                lambda: [kd.DistributeCallback(without)],
            ),
        ),
        Candidate(
            "kd_dp_seq_1",
            f'kd.DataParallel(sequence_axis="seq") on ({devices}, 1)',
            fitter(
                build_decoder(args, sequence),
                data,
                batch,
                lambda: [kd.DistributeCallback(with_axis)],
            ),
        ),
        Candidate(
            "keras_dp",
            "keras.distribution.DataParallel() set before build",
            fitter(native_model, data, batch, list, native.scope),
        ),
    ]
    if devices == 1:
        candidates.insert(
            0,
            Candidate(
                "plain",
                "plain Keras, no distribution",
                fitter(build_decoder(args, sequence), data, batch, list),
            ),
        )
    baseline = candidates[0].name
    timings = run_interleaved(
        candidates,
        repeats=args.axis_one_repeats,
        steps=args.axis_one_steps,
        skip_steps=args.axis_one_skip_steps,
        warmup_steps=args.warmup_steps,
        log=log,
    )
    result: dict[str, Any] = {
        "devices": devices,
        "platform": jax.devices()[0].platform,
        "device_kind": str(getattr(jax.devices()[0], "device_kind", "")),
        "sequence": sequence,
        "global_batch": batch,
        "baseline": baseline,
        "labels": {c.name: c.label for c in candidates},
        "timings": paired(timings, baseline),
        "programs": None,
    }
    if jax.devices()[0].platform == "cpu":
        plain = compiled_train_step(
            args, sequence, kd.DataParallel, {"batch": devices}, batch
        )
        split = compiled_train_step(
            args,
            sequence,
            lambda mesh: kd.DataParallel(mesh, sequence_axis="seq"),
            {"batch": devices, "seq": 1},
            batch,
        )
        result["programs"] = {
            "same_program": plain["program"] is not None
            and plain["program"] == split["program"],
            **{
                key: [plain[key], split[key]]
                for key in ("peak_bytes", "temp_bytes", "flops", "collective_bytes")
            },
        }
    return result


# -- output --------------------------------------------------------------------------
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_memory(rows: list[dict[str, Any]]) -> None:
    print(
        "| sequence | layout | global batch | tokens a device | temporaries a "
        "device | peak a device | kd.FSDP() on (8,) / this (temporaries) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['sequence']:,} | {row['layout']} | {row['global_batch']} | "
            f"{row['tokens_per_device']:,} | {row['temp_bytes'] / MIB:,.1f} MiB | "
            f"{row['peak_bytes'] / MIB:,.1f} MiB | **{row['temp_vs_fsdp']:.2f}** |"
        )


def print_time(rows: list[dict[str, Any]]) -> None:
    print("| sequence | layout (global batch 8) | ms/step | / kd.FSDP() on (8,) |")
    print("|---|---|---|---|")
    for row in rows:
        low, high = row["ratio_range"]
        print(
            f"| {row['sequence']:,} | {row['layout']} | {row['ms_per_step']:,.1f} | "
            f"**{row['ratio']:.3f}** ({low:.3f} to {high:.3f}) |"
        )


def print_axis_one(result: dict[str, Any]) -> None:
    baseline = result["labels"][result["baseline"]]
    print(
        f"{result['devices']} {result['platform']} device(s) "
        f"({result['device_kind']}), sequence {result['sequence']}, global batch "
        f"{result['global_batch']}"
    )
    print(f"| way | ms/step | / {baseline} | fastest step | / {baseline}'s |")
    print("|---|---|---|---|---|")
    for name, figures in result["timings"].items():
        low, high = figures["ratio_range"]
        print(
            f"| {result['labels'][name]} | {figures['ms_per_step']:,.2f} | "
            f"**{figures['ratio']:.3f}** ({low:.3f} to {high:.3f}) | "
            f"{figures['fastest_ms']:,.2f} | {figures['fastest_ratio']:.3f} |"
        )
    programs = result["programs"]
    if programs is None:
        print("(compiled programs compared on CPU devices only)")
        return
    peak, temp = programs["peak_bytes"], programs["temp_bytes"]
    print(
        f"compiled train step, kd.DataParallel() vs sequence axis of size 1: "
        f"same program: {programs['same_program']}; peak {peak[0]:,} vs "
        f"{peak[1]:,} bytes, temporaries {temp[0]:,} vs {temp[1]:,}, flops "
        f"{programs['flops'][0]:,.0f} vs {programs['flops'][1]:,.0f}"
    )


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small lengths, 1 repeat")
    parser.add_argument(
        "--axis-one",
        action="store_true",
        help="only the axis-of-size-1 comparison, on this host's devices",
    )
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--time-lengths", type=int, nargs="+")
    parser.add_argument("--axis-one-length", type=int)
    parser.add_argument("--axis-one-batch", type=int, default=8)
    parser.add_argument("--axis-one-repeats", type=int)
    parser.add_argument("--axis-one-steps", type=int)
    parser.add_argument("--axis-one-skip-steps", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--vocabulary", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--skip-steps", type=int)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--json", help="write every figure to this file")
    return parser.parse_args()


def fill_defaults(args: argparse.Namespace, platform: str) -> None:
    """The sizes not given: small on CPU devices; with `--axis-one` on an
    accelerator, a decoder the chip bounds rather than the host."""
    quick = args.quick
    defaults = {
        "lengths": [256, 512] if quick else [512, 1024, 2048, 4096],
        "time_lengths": [256] if quick else [512, 1024],
        "width": 128,
        "heads": 4,
        "vocabulary": 1024,
        "axis_one_length": 256,
        "repeats": 1 if quick else 3,
        "steps": 4 if quick else 6,
        "skip_steps": 1 if quick else 2,
        # The programs compared are the same: steps enough to see their
        # times agree.
        "axis_one_repeats": 1 if quick else 5,
        "axis_one_steps": 6 if quick else 20,
        "axis_one_skip_steps": 2 if quick else 3,
    }
    if args.axis_one and platform != "cpu":
        defaults.update(
            width=1024,
            heads=8,
            vocabulary=16384,
            axis_one_length=1024,
            axis_one_steps=30,
            axis_one_skip_steps=5,
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main() -> None:
    args = arguments()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if not args.axis_one:
        os.environ.setdefault("KERAS_DIST_CPU_DEVICES", str(DEVICES))
    # keras_dist first: it applies KERAS_DIST_CPU_DEVICES before JAX starts.
    import keras_dist  # noqa: F401  # isort: skip
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(
            "Context parallelism runs on JAX: set KERAS_BACKEND=jax. Received: "
            f"KERAS_BACKEND={keras.backend.backend()!r}"
        )
    fill_defaults(args, jax.devices()[0].platform)
    result: dict[str, Any] = {"model": describe(args), "args": vars(args)}
    if not args.axis_one:
        present = len(jax.devices("cpu"))
        if present != DEVICES:
            raise SystemExit(
                f"This benchmark needs {DEVICES} CPU devices; JAX has {present}. "
                f"Set KERAS_DIST_CPU_DEVICES={DEVICES} before it starts."
            )
        result["memory"] = memory_table(args)
        result["time"] = time_table(args)
    result["axis_one"] = axis_one(args)
    print(result["model"])
    if not args.axis_one:
        print("\nXLA's memory analysis of fit's compiled train step, per device:\n")
        print_memory(result["memory"])
        print("\nStep time (CPU, indicative):\n")
        print_time(result["time"])
    print("\nA sequence axis of size 1:\n")
    print_axis_one(result["axis_one"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
