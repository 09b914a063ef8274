"""In-process helpers shared by the benchmark entries.

An entry module builds its candidates (keras_dist and the native way), then
calls `run_interleaved` and `write_result`. The runner (`benchmarks/run.py`)
starts each entry in its own process, because the Keras backend and the device
count are fixed once a process has started them.

How a step is timed: `StepTimer` stamps `time.perf_counter()` at every
`on_train_batch_end`. Because it overrides that hook, Keras dispatches batch-end
callbacks synchronously and turns the step's logs into Python floats first, so
each stamp is taken after the step has really finished on the devices. The
difference between two consecutive stamps is then one whole loop iteration:
fetching and placing the batch, dispatching the compiled step, running it and
reading its logs back. Host-side overhead is therefore not hidden behind
asynchronous dispatch. (Synchronous batch ends also keep clear of an XLA CPU
hang: with 8 simulated devices on a 2-core machine, a plain `fit` with no
per-batch callback has been seen to stall in the all-reduce rendezvous and
abort after 40 s.) The first steps of each fit are skipped, so the
compilation that happens at the start of a fit is excluded (it is reported
separately as the first-step time).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras

import keras_dist as kd


class StepTimer(keras.callbacks.Callback):
    """Records when `fit` starts and when each training step ends."""

    def __init__(self) -> None:
        super().__init__()
        self.train_begin = 0.0
        self.batch_ends: list[float] = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batch_ends = []
        self.train_begin = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batch_ends.append(time.perf_counter())

    def step_times(self, skip_steps: int) -> list[float]:
        """Seconds per step, leaving out the first `skip_steps` steps."""
        stamps = self.batch_ends[skip_steps:]
        return [end - begin for begin, end in zip(stamps, stamps[1:], strict=False)]

    @property
    def first_step_s(self) -> float:
        """From `on_train_begin` to the end of step 0 (includes compilation)."""
        return self.batch_ends[0] - self.train_begin


class EpochTimer(keras.callbacks.Callback):
    """Seconds of each epoch of `fit` (`seconds`, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds.append(time.perf_counter() - self.began)


@dataclass
class Candidate:
    """One way to train, e.g. keras_dist or the backend's native way.

    Attributes:
        name: short key used in tables and JSON, e.g. `"keras_dist"`.
        label: what the candidate does, in a few words.
        fit: runs one `fit` of the requested number of steps with the extra
            callbacks it is given (the timer), and returns the `History`.
    """

    name: str
    label: str
    fit: Callable[[int, list[Any]], Any]


def _fit_once(candidate: Candidate, steps: int, skip_steps: int) -> dict[str, Any]:
    timer = StepTimer()
    start = time.perf_counter()
    history = candidate.fit(steps, [timer])
    wall = time.perf_counter() - start
    if len(timer.batch_ends) != steps:
        raise RuntimeError(
            f"Candidate {candidate.name!r} ran {len(timer.batch_ends)} steps; "
            f"the benchmark asked for {steps}."
        )
    times = timer.step_times(skip_steps)
    return {
        "median_step_s": statistics.median(times),
        "mean_step_s": statistics.fmean(times),
        "first_step_s": timer.first_step_s,
        "fit_wall_s": wall,
        "final_loss": float(history.history["loss"][-1]),
        # Microsecond resolution is plenty and keeps the JSON small.
        "step_times_s": [round(t, 6) for t in times],
    }


def _log_to_stderr(message: str) -> None:
    # stdout may carry the JSON result; progress goes to stderr.
    print(message, file=sys.stderr, flush=True)


def run_interleaved(
    candidates: Sequence[Candidate],
    *,
    repeats: int,
    steps: int,
    skip_steps: int,
    warmup_steps: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Warm every candidate up, then time them in turns: A, B, A, B, ...

    Interleaving within one process means a slow spell of the machine (another
    job, frequency scaling) hits every candidate alike instead of biasing one.
    The warm-up fits go through the same timed path as the measured ones, so
    they compile exactly what the measured fits run.

    Returns:
        `{"candidates": [...], "warmup_loss": {...}}` where each candidate
        holds one record per repetition (see `_fit_once`).
    """
    if steps < skip_steps + 2 or warmup_steps < 2:
        raise ValueError(
            f"`steps` must leave at least 2 timed steps after skipping "
            f"{skip_steps}, and `warmup_steps` must be at least 2. Received: "
            f"steps={steps}, warmup_steps={warmup_steps}"
        )
    log = log or _log_to_stderr
    warmup_loss = {}
    for candidate in candidates:
        record = _fit_once(candidate, warmup_steps, skip_steps=0)
        warmup_loss[candidate.name] = record["final_loss"]
        log(f"warm-up {candidate.name}: {record['fit_wall_s']:.2f} s")
    records: dict[str, list[dict[str, Any]]] = {c.name: [] for c in candidates}
    for repeat in range(repeats):
        for candidate in candidates:
            record = _fit_once(candidate, steps, skip_steps)
            records[candidate.name].append(record)
            log(
                f"repeat {repeat + 1}/{repeats} {candidate.name}: "
                f"median step {record['median_step_s'] * 1e3:.2f} ms, "
                f"first step {record['first_step_s']:.2f} s"
            )
    return {
        "candidates": [
            {"name": c.name, "label": c.label, "repeats": records[c.name]}
            for c in candidates
        ],
        "warmup_loss": warmup_loss,
    }


def entry_arguments(description: str) -> argparse.Namespace:
    """The command line every entry accepts (the runner passes all of it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument(
        "--json-out", default="-", help="where to write the result; - is stdout"
    )
    return parser.parse_args()


def require_processes(expected: int) -> None:
    """Raise unless this job has `expected` processes (a multi-process entry
    started without `keras-dist launch`)."""
    if kd.num_processes() != expected:
        raise RuntimeError(
            f"This entry needs {expected} processes; it runs in "
            f"{kd.num_processes()}. Start it with `keras-dist launch "
            f"--nproc-per-node {expected}` (run.py does)."
        )


def run_in_own_job(
    script: str,
    arguments: Sequence[str],
    processes: int,
    *,
    most: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `script` with `arguments` in a process of its own (under `keras-dist
    launch --nproc-per-node processes` when several), which prints one JSON
    line per process, and return process 0's figures with, for each key of
    `most` that is not None, the largest any process gave. Exits with the
    run's error when it fails or its processes did not join one job."""
    command = [sys.executable, script, *arguments]
    if processes > 1:
        command[1:1] = [
            "-m",
            "keras_dist",
            "launch",
            "--nproc-per-node",
            str(processes),
        ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ) if env is None else env,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    if processes == 1:
        return json.loads(done.stdout.strip().splitlines()[-1])
    # `keras-dist launch` prefixes each line with its rank.
    each = [
        json.loads(line.split("] ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith("[rank ") and line.split("] ", 1)[1].startswith("{")
    ]
    if len(each) != processes or each[0].get("processes", processes) != processes:
        raise SystemExit(
            f"expected one result from each of {processes} processes of one job:"
            f"\n{done.stdout}"
        )
    result = dict(each[0])
    for key in most:
        if result[key] is not None:
            result[key] = max(one[key] for one in each)
    return result


def entry_result(
    entry: str,
    args: argparse.Namespace,
    *,
    devices: int,
    global_batch: int,
    **fields: Any,
) -> dict[str, Any]:
    """The JSON every entry writes: how it ran, then its own `fields`."""
    return {
        "entry": entry,
        "backend": keras.backend.backend(),
        "devices": devices,
        "global_batch": global_batch,
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "repeats": args.repeats,
        **fields,
    }


def versions() -> dict[str, str]:
    """The versions an entry ran with: Keras, its backend's engine, keras_dist."""
    backend = keras.backend.backend()
    return {
        "keras": keras.__version__,
        backend: importlib.import_module(backend).__version__,
        "keras_dist": kd.__version__,
    }


def report(
    entry: str,
    args: argparse.Namespace,
    *,
    devices: int,
    global_batch: int,
    **fields: Any,
) -> None:
    """Write the entry's result where `--json-out` says: `entry_result` with
    the versions it ran with (the tail every entry shares)."""
    result = entry_result(
        entry,
        args,
        devices=devices,
        global_batch=global_batch,
        versions=versions(),
        **fields,
    )
    write_result(args.json_out, result)


def write_result(path: str, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def compare_memory(memory: dict[str, dict[str, Any]], devices: int) -> None:
    """Add to each candidate's memory record its bytes per device as a fraction
    of the replicated candidate's (`keras_dist_dp`) and that fraction times
    `devices` (1 means exactly 1/N), with FSDP's target: 1/N
    within 5 % (`--check` reads it)."""
    replicated_bytes = memory["keras_dist_dp"]["max_device_bytes"]
    for record in memory.values():
        record["fraction_of_replicated"] = record["max_device_bytes"] / replicated_bytes
        record["times_devices"] = record["fraction_of_replicated"] * devices
    memory["keras_dist_fsdp"]["target_times_devices"] = 1.05


def devices_holding(model: Any) -> int:
    """How many devices a JAX model's first kernel lives on."""
    return len(model.trainable_variables[0].value.sharding.device_set)
