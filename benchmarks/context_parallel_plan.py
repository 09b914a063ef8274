"""Per-chip peak of a long-sequence full fine-tune, with and without a sequence
axis: `kd.plan(topology=...)` on a Gemma-2B-shaped `GemmaCausalLM` (Gemma 2B's
configuration, random weights: nothing is downloaded or allocated), float32
variables and compute, Adam, remat `"full"` (each decoder block recomputed).

For each topology and sequence length, two distributions at the smallest
global batch each mesh allows (one sequence per batch-axis shard):

    fsdp       kd.FSDP(remat="full") on a one-axis mesh of every chip
               ("batch": N): N sequences
    fsdp+seq   kd.FSDP(remat="full", sequence_axis="seq") on ("batch", "seq")
               = (1, N): one sequence split over every chip

The figure is XLA's peak of the compiled train step per chip (arguments,
outputs, temporaries, code, less the donated state), against the memory JAX
lets a program use on the chip (15.75 GiB on v5e; 95 GiB on v5p, its data sheet's HBM).

    # needs libtpu (pip install "keras-dist[tpu]"); CPU only is fine
    KERAS_BACKEND=jax python benchmarks/context_parallel_plan.py
    KERAS_BACKEND=jax python benchmarks/context_parallel_plan.py \\
        --topologies v5e-8 --lengths 8192 --json /tmp/cp.jsonl

Each case is compiled in a process of its own (a compile the host cannot
finish is reported, not fatal); a case takes minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Gemma 2B's configuration (keras_hub's `gemma_2b_en` preset: 2,506,172,416
# parameters), as the plan_search benchmark plans it.
from benchmarks.plan_search_llm import GEMMA_2B  # noqa: E402

POLICIES = ("fsdp", "fsdp+seq")
LABELS = {"fsdp": "FSDP", "fsdp+seq": "FSDP + sequence axis"}
GIB = 2**30
# XLA's out-of-memory words: "... required for HLO temporaries (28.25G) ...".
TEMPORARIES = re.compile(r"HLO temporaries \(([0-9.]+)([GT])\)")


def gemma_2b():
    """Gemma 2B's shape in a `GemmaCausalLM`, float32, compiled with Adam."""
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415

    backbone = keras_hub.models.GemmaBackbone(**GEMMA_2B, dtype="float32")
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def run_case(topology: str, length: int, policy: str) -> dict:
    """Plan one case in this process."""
    import keras_dist as kd  # noqa: PLC0415
    from keras_dist.planner.topology import parse_topology  # noqa: PLC0415

    chips = parse_topology(topology, 1).chips
    if policy == "fsdp":
        mesh = {"batch": chips}
        batch = chips

        def distribution(device_mesh):
            return kd.FSDP(device_mesh, remat="full")

    else:
        mesh = {"batch": 1, "seq": chips}
        batch = 1

        def distribution(device_mesh):
            return kd.FSDP(device_mesh, remat="full", sequence_axis="seq")

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # for_keras_hub's one key/value head
        result = kd.plan(
            gemma_2b,
            distribution,
            mesh=mesh,
            topology=topology,
            batch_size=batch,
            sequence_length=length,
            steps=("train",),
        )
    train = result.compiled.steps["train"]
    return {
        "topology": topology,
        "sequence_length": length,
        "policy": policy,
        "mesh": mesh,
        "global_batch": batch,
        "peak_bytes": train.peak_bytes,
        "memory_bytes": result.compiled.memory,
        "fits": bool(
            train.error is None
            and train.peak_bytes is not None
            and result.compiled.memory is not None
            and train.peak_bytes <= result.compiled.memory
        ),
        "error": (train.error or "")[:300] or None,
        "all_gather_bytes": (train.collective_bytes or {}).get("all-gather"),
        "compile_seconds": train.compile_seconds,
        "seconds": time.perf_counter() - started,
    }


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def print_table(records: list[dict]) -> None:
    print(
        "| topology | tokens | distribution | mesh | global batch | "
        "peak per chip (GiB) | chip memory (GiB) | fits |"
    )
    print("|---|---:|---|---|---:|---:|---:|---|")
    for record in records:
        if "peak_bytes" not in record:
            peak, fits = "compile failed", "?"
        elif record.get("error"):
            needed = TEMPORARIES.search(record["error"])
            peak = "refused" + (
                f" (temporaries {needed.group(1)} {needed.group(2)}iB)"
                if needed
                else " by XLA"
            )
            fits = "no"
        else:
            peak, fits = _gib(record["peak_bytes"]), "yes" if record["fits"] else "no"
        mesh = ", ".join(f"{k}={v}" for k, v in record["mesh"].items())
        print(
            f"| {record['topology']} | {record['sequence_length'] // 1024}k | "
            f"{LABELS.get(record['policy'], record['policy'])} | {mesh} | "
            f"{record['global_batch']} | {peak} | "
            f"{_gib(record.get('memory_bytes'))} | {fits} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="v5e-8,v5p-64")
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", metavar="PATH", help="append each case there")
    parser.add_argument(
        "--show", nargs="+", metavar="PATH", help="print the table of --json files"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # topology,length,policy
    arguments = parser.parse_args()
    if arguments.show:
        shown = []
        for path in arguments.show:
            with open(path) as file:
                shown += [json.loads(line) for line in file if line.strip()]
        print_table(shown)
        return 0
    if arguments.case:
        topology, length, policy = arguments.case.split(",")
        print("CASE " + json.dumps(run_case(topology, int(length), policy)))
        return 0
    records = []
    for topology in arguments.topologies.split(","):
        for length in (int(n) for n in arguments.lengths.split(",")):
            for policy in arguments.policies.split(","):
                if policy not in POLICIES:
                    parser.error(f"--policies: one of {POLICIES}; got {policy!r}")
                case = f"{topology},{length},{policy}"
                try:
                    done = subprocess.run(
                        [sys.executable, __file__, "--case", case],
                        capture_output=True,
                        text=True,
                        timeout=arguments.timeout,
                        env={**os.environ, "KERAS_BACKEND": "jax"},
                    )
                    lines = [
                        line[5:]
                        for line in done.stdout.splitlines()
                        if line.startswith("CASE ")
                    ]
                    record = (
                        json.loads(lines[-1])
                        if lines
                        else {"failed": done.stderr.strip()[-500:]}
                    )
                except subprocess.TimeoutExpired:
                    record = {"failed": f"timed out after {arguments.timeout} s"}
                record.setdefault("topology", topology)
                record.setdefault("sequence_length", length)
                record.setdefault("policy", policy)
                record.setdefault("global_batch", "-")
                record.setdefault("mesh", {})
                records.append(record)
                print(json.dumps(record), flush=True)
                if arguments.json:
                    with open(arguments.json, "a") as file:
                        file.write(json.dumps(record) + "\n")
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
