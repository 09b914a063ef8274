"""How keras_dist's cost grows with the device count: one table, every backend.

Runs the data-parallel entries of `run.py` on the same model and global batch
(`mlp.py`: MLP 256-512-512-10, Adam, global batch 512) for several counts:
PyTorch on 1, 2 and 4 processes (`torch_ddp_mlp`: keras_dist's `fit` against
the guide's hand-written DDP loop; on one process also plain Keras' `fit`),
JAX on 2, 4 and 8 simulated devices (`jax_data_parallel`: against Keras' own
`keras.distribution.DataParallel`) and TensorFlow on 2, 4 and 8 logical
devices (`tf_mirrored`: against a raw `MirroredStrategy` fit). Each entry
times its candidates in turns within one process (the step-time ratio is
taken per repeat); the entries themselves run round-robin `--rounds` times,
so that the machine's drift spreads over all of them. Prints one table (the
median over the rounds of each entry's median ratio, and the range) and, with
`--json`, everything.

```shell
PYTHONPATH=. python benchmarks/scaling.py --rounds 2 --repeats 5 --steps 30
```
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (backend, count, entry in run.py, keras_dist's candidate, the native one)
ROWS = (
    ("torch", 1, "torch_ddp_mlp_1", "keras_dist", "torch_loop"),
    ("torch", 2, "torch_ddp_mlp", "keras_dist", "torch_loop"),
    ("torch", 4, "torch_ddp_mlp_4", "keras_dist", "torch_loop"),
    ("jax", 2, "jax_data_parallel_2", "keras_dist", "native"),
    ("jax", 4, "jax_data_parallel_4", "keras_dist", "native"),
    ("jax", 8, "jax_data_parallel", "keras_dist", "native"),
    ("tensorflow", 2, "tf_mirrored_2", "keras_dist", "native"),
    ("tensorflow", 4, "tf_mirrored", "keras_dist", "native"),
    ("tensorflow", 8, "tf_mirrored_8", "keras_dist", "native"),
)


def run_entry(entry: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "result.json"
        command = [
            sys.executable, str(HERE / "run.py"), "--entries", entry,
            "--repeats", str(args.repeats), "--steps", str(args.steps),
            "--json", str(out),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1) or not out.exists():
            raise SystemExit(
                f"{entry} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            )
        payload = json.loads(out.read_text(encoding="utf-8"))
    if entry not in payload["entries"]:
        raise SystemExit(f"{entry} failed: {payload['failures']}")
    return payload["entries"][entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backends", nargs="+", default=["torch", "jax", "tensorflow"])
    parser.add_argument("--json", help="also write every entry's result here")
    args = parser.parse_args()
    rows = [row for row in ROWS if row[0] in args.backends]
    results: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for _, _, entry, _, _ in rows:
            print(f"round {round_index + 1}: {entry} ...", file=sys.stderr, flush=True)
            results.setdefault(entry, []).append(run_entry(entry, args))
    table = []
    for backend, count, entry, ours, native in rows:
        ratios, ours_ms, native_ms, plain = [], [], [], []
        for result in results[entry]:
            candidates = result["summary"]["candidates"]
            ratios.append(candidates[ours]["median_ratio"])
            ours_ms.append(1000 * candidates[ours]["median_step_s"])
            native_ms.append(1000 * candidates[native]["median_step_s"])
            if "plain_keras" in candidates:
                plain.append(candidates["plain_keras"]["median_ratio"])
        table.append(
            {
                "backend": backend,
                "devices": count,
                "entry": entry,
                "keras_dist_step_ms": statistics.median(ours_ms),
                "native_step_ms": statistics.median(native_ms),
                "ratio": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "plain_keras_ratio": statistics.median(plain) if plain else None,
                "rounds": len(ratios),
            }
        )
    print(
        "| backend | devices | keras_dist step ms | native step ms "
        "| keras_dist / native (median, range) |"
    )
    print("|---|---|---|---|---|")
    for row in table:
        extra = (
            f"; plain Keras / loop {row['plain_keras_ratio']:.3f}"
            if row["plain_keras_ratio"] is not None
            else ""
        )
        print(
            f"| {row['backend']} | {row['devices']} | {row['keras_dist_step_ms']:.2f} "
            f"| {row['native_step_ms']:.2f} | **{row['ratio']:.3f}** "
            f"({row['ratio_range'][0]:.3f} to {row['ratio_range'][1]:.3f}){extra} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"table": table, "entries": results}, indent=2), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
