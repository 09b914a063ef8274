"""Benchmark runner: keras_dist against each backend's native way to distribute.

Usage:

```shell
python benchmarks/run.py [--entries jax_data_parallel] [--repeats N] [--steps S]
                         [--json OUT]
```

Every entry runs in its own process (the Keras backend and the number of
simulated devices are fixed once a process has started them), with the
environment its registry record asks for and a timeout. The entry times its
candidates in turns inside that one process and prints raw timings as JSON;
this runner computes the medians and ratios and prints one table.

To add an entry (a torch DDP or `tf.distribute` comparison, say): write
`benchmarks/entries/<name>.py` following `entries/jax_data_parallel.py` (its
JSON names a `baseline` candidate and holds per-repetition records), then add
an `Entry` to `ENTRIES` below.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRIES_DIR = Path(__file__).resolve().parent / "entries"
TARGET_RATIO = 1.03


@dataclass(frozen=True)
class Entry:
    """How to run one benchmark entry.

    Attributes:
        name: the key used on the command line; also the script's file name
            under `benchmarks/entries/`.
        backend: the `KERAS_BACKEND` the entry's process runs with.
        description: one line for the table.
        cpu_devices: `KERAS_DIST_CPU_DEVICES` for the process, or None to
            leave it unset (torch: the launcher's processes are the devices).
        launcher: arguments placed between the Python executable and the
            script, e.g. `("-m", "keras_dist", "launch", "--nproc-per-node",
            "2")` for a multi-process entry. Only process 0 writes the JSON.
        env: extra environment variables.
        timeout_s: the process is killed (with its children) after this long.
        target: the highest acceptable keras_dist/native step-time ratio for
            this entry, or None for `--target`'s default. An explicit
            `--target` overrides it.
        script_name: the script under `benchmarks/entries/` (without `.py`)
            when it is not `name`: one script run with several device counts
            is one entry per count.
        references: candidates timed beside the others for comparison only,
            not held to `target` (keras_dist's replicated policy in an FSDP
            entry, FSDP2 without resharding).
    """

    name: str
    backend: str
    description: str
    cpu_devices: int | None = 8
    launcher: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    target: float | None = None
    script_name: str | None = None
    references: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return ENTRIES_DIR / f"{self.script_name or self.name}.py"


ENTRIES: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        *(
            Entry(
                name="jax_data_parallel"
                if devices == 8
                else f"jax_data_parallel_{devices}",
                backend="jax",
                description=f"DataParallel, {devices} simulated CPU devices: "
                "kd.DistributeCallback vs keras.distribution.DataParallel",
                cpu_devices=devices,
                timeout_s=300.0,
                script_name="jax_data_parallel",
            )
            for devices in (8, 4, 2)
        ),
        Entry(
            name="torch_ddp",
            backend="torch",
            description="DistributedDataParallel, 2 processes (gloo, CPU): "
            "fit + kd.DistributeCallback vs the keras.io guide's hand-written loop",
            cpu_devices=None,
            launcher=("-m", "keras_dist", "launch", "--nproc-per-node", "2"),
            timeout_s=600.0,
            # At least 0.9 of the hand-written loop's samples/s.
            target=round(1 / 0.9, 3),
        ),
        *(
            Entry(
                name="tf_mirrored" if devices == 4 else f"tf_mirrored_{devices}",
                backend="tensorflow",
                description=f"DataParallel, {devices} logical CPU devices: "
                "kd.DistributeCallback vs a raw MirroredStrategy fit",
                cpu_devices=devices,
                timeout_s=600.0,
                target=1.05,
                script_name="tf_mirrored",
            )
            for devices in (4, 2, 8)
        ),
        *(
            Entry(
                name="torch_ddp_mlp"
                if processes == 2
                else f"torch_ddp_mlp_{processes}",
                backend="torch",
                description=f"DistributedDataParallel, {processes} process(es) (gloo, "
                "CPU), the shared MLP: fit + kd.DistributeCallback vs the guide's "
                "hand-written loop (one process: also plain Keras' fit)",
                cpu_devices=None,
                launcher=(
                    "-m",
                    "keras_dist",
                    "launch",
                    "--nproc-per-node",
                    str(processes),
                ),  # fmt: skip
                timeout_s=600.0,
                target=round(1 / 0.9, 3),
                script_name="torch_ddp_mlp",
                references=("plain_keras",),
            )
            for processes in (2, 1, 4)
        ),
        *(
            Entry(
                name="jax_fsdp" if devices == 8 else f"jax_fsdp_{devices}",
                backend="jax",
                description=f"FSDP, {devices} simulated CPU devices: kd.FSDP vs "
                "keras.distribution.ModelParallel with the same layouts; "
                "per-device bytes vs DataParallel",
                cpu_devices=devices,
                timeout_s=400.0,
                target=1.05,
                script_name="jax_fsdp",
                references=("keras_dist_dp",),
            )
            for devices in (8, 4, 2)
        ),
        Entry(
            name="throughput_overhead",
            backend="jax",
            description="kd.callbacks.Throughput, 8 simulated CPU devices: "
            "the same DataParallel fit with and without it",
            timeout_s=400.0,
            target=1.01,
        ),
        Entry(
            name="torch_fsdp",
            backend="torch",
            description="FSDP, 2 processes (gloo, CPU): kd.FSDP vs a "
            "hand-written fully_shard (FSDP2) loop, also without resharding; "
            "per-process bytes vs DataParallel",
            cpu_devices=None,
            launcher=("-m", "keras_dist", "launch", "--nproc-per-node", "2"),
            timeout_s=600.0,
            target=1.05,
            references=("fully_shard_no_reshard",),
        ),
    )
}
# How long an entry gets to stop after SIGTERM before it is killed: longer than
# `keras-dist launch`'s own grace period for its ranks (10 s).
STOP_GRACE_S = 15.0


# -- running one entry -----------------------------------------------------------
class EntryFailed(RuntimeError):
    pass


def entry_environment(entry: Entry) -> dict[str, str]:
    env = dict(os.environ)
    env["KERAS_BACKEND"] = entry.backend
    if entry.cpu_devices is None:
        env.pop("KERAS_DIST_CPU_DEVICES", None)
    else:
        env["KERAS_DIST_CPU_DEVICES"] = str(entry.cpu_devices)
    # Entries import `benchmarks.harness`; the repository root must be importable.
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if part
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(entry.env)
    return env


def run_entry(
    entry: Entry, entry_args: Sequence[str], *, verbose: bool
) -> dict[str, Any]:
    """Run `entry` in a subprocess and return the JSON it wrote."""
    with tempfile.TemporaryDirectory(prefix="keras_dist_bench_") as folder:
        out_path = Path(folder) / "result.json"
        command = [
            sys.executable,
            *entry.launcher,
            str(entry.script),
            *entry_args,
            "--json-out",
            str(out_path),
        ]
        # A session of its own, so a timeout can end the entry's children too.
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=entry_environment(entry),
            stdout=None if verbose else subprocess.PIPE,
            stderr=None if verbose else subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=entry.timeout_s)
        except subprocess.TimeoutExpired:
            output = _stop(process)
            raise EntryFailed(
                f"{entry.name} did not finish within {entry.timeout_s:g} s.\n"
                f"{_tail(output)}"
            ) from None
        if process.returncode != 0:
            raise EntryFailed(
                f"{entry.name} exited with status {process.returncode}.\n"
                f"{_tail(output)}"
            )
        if not out_path.exists():
            raise EntryFailed(f"{entry.name} wrote no result.\n{_tail(output)}")
        return json.loads(out_path.read_text(encoding="utf-8"))


def _stop(process: subprocess.Popen) -> str | None:
    """End a timed-out entry and everything it started; return its output.

    SIGTERM first: `keras-dist launch` starts each rank in a session of its
    own, out of reach of a signal to the entry's process group, and stops them
    itself when it gets SIGTERM. Whatever is left then gets SIGKILL.
    """
    _signal_group(process.pid, signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    else:
        _signal_group(process.pid, signal.SIGKILL)  # anything left behind
    return output


def _signal_group(process_group: int, signum: int) -> None:
    try:
        os.killpg(process_group, signum)
    except ProcessLookupError:
        return


def _tail(output: str | None, lines: int = 40) -> str:
    if not output:
        return "(output was streamed above)"
    return "\n".join(output.splitlines()[-lines:])


# -- statistics ----------------------------------------------------------------------
def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per candidate and paired ratios against the baseline.

    The ratio is taken per repetition (candidate and baseline ran back to back)
    and its median reported, so slow drift of the machine cancels out.
    """
    baseline = result["baseline"]
    by_name = {c["name"]: c["repeats"] for c in result["candidates"]}
    batch = result["global_batch"]
    candidates = {}
    for name, repeats in by_name.items():
        steps = [r["median_step_s"] for r in repeats]
        median_step = statistics.median(steps)
        ratios = [
            mine["median_step_s"] / base["median_step_s"]
            for mine, base in zip(repeats, by_name[baseline], strict=True)
        ]
        pooled = [t for r in repeats for t in r["step_times_s"]]
        pooled_base = [t for r in by_name[baseline] for t in r["step_times_s"]]
        candidates[name] = {
            "median_step_s": median_step,
            "pooled_median_step_s": statistics.median(pooled),
            "pooled_ratio": statistics.median(pooled) / statistics.median(pooled_base),
            "min_step_s": min(steps),
            "max_step_s": max(steps),
            "samples_per_s": batch / median_step,
            "median_first_step_s": statistics.median(
                r["first_step_s"] for r in repeats
            ),
            "median_fit_wall_s": statistics.median(r["fit_wall_s"] for r in repeats),
            "ratio_per_repeat": ratios,
            "median_ratio": statistics.median(ratios),
        }
    return {"baseline": baseline, "candidates": candidates}


# -- report ----------------------------------------------------------------------------
def print_report(results: dict[str, dict[str, Any]], failures: dict[str, str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for name, result in results.items():
        summary = result["summary"]
        target = result["target"]
        table = Table(
            title=f"{name}: steady-state step time, median of {result['repeats']} "
            f"interleaved repeats",
            caption=f"{result['model']}; global batch {result['global_batch']} on "
            f"{result['devices']} devices; {result['steps']} steps per fit, the "
            f"first {result['skip_steps']} not timed",
        )
        for column in (
            "candidate",
            "step ms",
            "range ms",
            "samples/s",
            "1st step s",
            "fit s",
            f"/{summary['baseline']}",
        ):
            table.add_column(
                column, justify="left" if column == "candidate" else "right"
            )
        for candidate, stats in summary["candidates"].items():
            ratio = stats["median_ratio"]
            if candidate == summary["baseline"]:
                ratio_text = "1"
            elif not held_to_target(result, candidate):
                ratio_text = f"{ratio:.3f}"
            else:
                style = "green" if ratio <= target else "red"
                ratio_text = f"[{style}]{ratio:.3f}[/{style}]"
            table.add_row(
                candidate,
                f"{stats['median_step_s'] * 1e3:.2f}",
                f"{stats['min_step_s'] * 1e3:.1f}-{stats['max_step_s'] * 1e3:.1f}",
                f"{stats['samples_per_s']:,.0f}",
                f"{stats['median_first_step_s']:.2f}",
                f"{stats['median_fit_wall_s']:.2f}",
                ratio_text,
            )
        console.print(table)
        console.print(
            f"devices holding the weights: {result['devices_used']}; warm-up loss: "
            + ", ".join(f"{k}={v:.5f}" for k, v in result["warmup_loss"].items()),
            markup=False,
        )
        for candidate, stats in summary["candidates"].items():
            if candidate == summary["baseline"]:
                continue
            if not held_to_target(result, candidate):
                verdict = "a reference, no target"
            elif stats["median_ratio"] <= target:
                verdict = f"meets target <= {target}"
            else:
                verdict = f"ABOVE target <= {target}"
            per_repeat = ", ".join(f"{r:.3f}" for r in stats["ratio_per_repeat"])
            console.print(
                f"{candidate}/{summary['baseline']} median step-time ratio "
                f"{stats['median_ratio']:.3f} ({verdict}); "
                f"per repeat: {per_repeat}; ratio of the medians of all timed "
                f"steps: {stats['pooled_ratio']:.3f}",
                markup=False,
            )
        if "memory" in result:
            print_memory(console, name, result)
    for name, message in failures.items():
        console.print(f"{name} failed: {message}", markup=False, style="red")


def print_memory(console: Any, name: str, result: dict[str, Any]) -> None:
    """The table of an entry that measured per-device bytes (FSDP entries)."""
    from rich.table import Table

    devices = result["devices"]
    table = Table(
        title=f"{name}: bytes of weights + optimizer variables held per device",
        caption=f"{devices} devices; x devices = (bytes / replicated bytes) x "
        f"{devices}: 1 means exactly 1/{devices} of the replicated figure "
        "(target for keras_dist_fsdp: at most 1.05, checked by --check)",
    )
    for column in ("candidate", "bytes per device", "/replicated", "x devices"):
        table.add_column(column, justify="left" if column == "candidate" else "right")
    for candidate, record in result["memory"].items():
        times = f"{record['times_devices']:.4f}"
        if "target_times_devices" in record:
            style = (
                "green"
                if record["times_devices"] <= record["target_times_devices"]
                else "red"
            )
            times = f"[{style}]{times}[/{style}]"
        table.add_row(
            candidate,
            f"{record['max_device_bytes']:,}",
            f"{record['fraction_of_replicated']:.4f}",
            times,
        )
    console.print(table)
    for candidate, record in result["memory"].items():
        if record["fraction_of_replicated"] < 1 and "replicated" in record:
            console.print(
                f"{candidate} keeps replicated: "
                + (", ".join(record["replicated"]) or "nothing"),
                markup=False,
            )


# -- command line --------------------------------------------------------------------
def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Compare keras_dist with each backend's native distribution."
    )
    parser.add_argument(
        "--entries",
        nargs="+",
        choices=sorted(ENTRIES),
        default=sorted(ENTRIES),
        help="entries to run (default: all)",
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed fits per candidate"
    )
    parser.add_argument("--steps", type=int, default=60, help="steps per timed fit")
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=5,
        help="steps at the start of each fit left out of the timing",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="steps of the warm-up fit"
    )
    parser.add_argument("--json", metavar="OUT", help="also write all results here")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="highest acceptable keras_dist/native step-time ratio (default: "
        f"the entry's own target, else {TARGET_RATIO})",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 when a ratio is above --target",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="stream the entries' output"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1. Received: {args.repeats}")
    if args.steps < args.skip_steps + 2:
        parser.error(
            "--steps must leave at least 2 timed steps after --skip-steps. "
            f"Received: --steps {args.steps} --skip-steps {args.skip_steps}"
        )
    if args.warmup_steps < 2:
        parser.error(
            f"--warmup-steps must be at least 2. Received: {args.warmup_steps}"
        )
    return args


def held_to_target(result: dict[str, Any], candidate: str) -> bool:
    """Whether the step-time target applies to `candidate` of an entry's
    `result`: every candidate but the baseline and the entry's references."""
    return candidate != result["summary"]["baseline"] and candidate not in result.get(
        "references", ()
    )


def entry_target(entry: Entry, requested: float | None) -> float:
    """`--target` when given, else the entry's own, else `TARGET_RATIO`."""
    if requested is not None:
        return requested
    return entry.target if entry.target is not None else TARGET_RATIO


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    entry_args = [
        "--repeats",
        str(args.repeats),
        "--steps",
        str(args.steps),
        "--skip-steps",
        str(args.skip_steps),
        "--warmup-steps",
        str(args.warmup_steps),
    ]
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for name in args.entries:
        entry = ENTRIES[name]
        print(f"running {name} ({entry.backend}) ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            result = run_entry(entry, entry_args, verbose=args.verbose)
        except EntryFailed as error:
            failures[name] = str(error)
            continue
        result["summary"] = summarize(result)
        result["target"] = entry_target(entry, args.target)
        result["references"] = list(entry.references)
        result["elapsed_s"] = time.perf_counter() - start
        results[name] = result
        print(f"{name} done in {result['elapsed_s']:.0f} s", file=sys.stderr)
    print_report(results, failures)
    if args.json:
        payload = {
            # None: each entry's own, under "target" in its result.
            "target_ratio": args.target,
            "python": sys.version.split()[0],
            "platform": sys.platform,
            "cpu_count": os.cpu_count(),
            "entries": results,
            "failures": failures,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    if failures:
        return 2
    above = [
        name
        for name, result in results.items()
        for candidate, stats in result["summary"]["candidates"].items()
        if held_to_target(result, candidate)
        and stats["median_ratio"] > result["target"]
    ]
    above += [
        name
        for name, result in results.items()
        for record in result.get("memory", {}).values()
        if record["times_devices"] > record.get("target_times_devices", float("inf"))
    ]
    return 1 if args.check and above else 0


if __name__ == "__main__":
    sys.exit(main())
