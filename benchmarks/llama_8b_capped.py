"""A full fine-tune of a decoder of Llama-3-8B's shape on one GPU whose JAX
memory is capped to an 80 GB card's (`XLA_PYTHON_CLIENT_MEM_FRACTION`, set
before JAX starts: 0.55 of an H200's 139 GiB is about an H100's 80 GB).

The model is a KerasHub `LlamaCausalLM` made from a configuration (random
weights, nothing downloaded): 32 layers, hidden 4096, MLP 14336, 32 query
heads, 8 key-value heads, vocabulary 128256, `mixed_bfloat16` (float32
weights), AdamW. Each phase runs in a process of its own (a phase that runs
out of memory leaves nothing behind for the next):

- `probe`: the host link's raw rate, `jax.device_put` of 4 GiB from pinned
  host memory to the GPU and back, GB/s each way;
- `plain`: plain Keras' `fit`: the out-of-memory error and what XLA says it
  needs;
- `kd`: `kd.plan_search(build, topology="local", ...)` compiles the
  candidates for this GPU (offload, optimizer-state dtype and remat are
  among them) and keras_dist trains with the best: ms/step and tokens/s,
  without and with gradient accumulation (4 micro-steps), the device's peak
  and the offloaded state's host bytes against the plan, and the step's host
  traffic in GB/s each way against the probe's.

One JSON object (`--json`, and the last line printed).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 KERAS_BACKEND=jax \\
        python benchmarks/llama_8b_capped.py --json llama_8b.json

`--layers` makes a shallower decoder of the same width, for a GPU session
without the time for 32 layers; `--smoke` a tiny one, to check the script on
a CPU (its figures then say nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

LLAMA3_8B = {
    "vocabulary_size": 128256,
    "num_layers": 32,
    "num_query_heads": 32,
    "num_key_value_heads": 8,
    "hidden_dim": 4096,
    "intermediate_dim": 14336,
}
SMOKE = {
    "vocabulary_size": 512,
    "num_layers": 2,
    "num_query_heads": 4,
    "num_key_value_heads": 2,
    "hidden_dim": 64,
    "intermediate_dim": 128,
}
GIB = 2**30


def _shape(args: argparse.Namespace) -> dict[str, int]:
    shape = dict(SMOKE if args.smoke else LLAMA3_8B)
    if args.layers:
        shape["num_layers"] = args.layers
    return shape


def _build(shape: dict[str, int], accumulation: int = 1):
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(**shape, dtype="mixed_bfloat16")
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    options = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-5, **options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _data(shape: dict[str, int], rows: int, sequence: int):
    import numpy as np  # noqa: PLC0415

    tokens = np.random.default_rng(0).integers(
        0, shape["vocabulary_size"], (rows, sequence + 1)
    )
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((rows, sequence), "int32"),
    }
    return x, tokens[:, 1:].astype("int32")


def _device() -> Any:
    import jax  # noqa: PLC0415

    return jax.devices()[0]


def _memory() -> dict[str, Any]:
    stats = _device().memory_stats() or {}
    return {
        "bytes_limit": stats.get("bytes_limit"),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    }


def probe(args: argparse.Namespace) -> dict[str, Any]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    device = _device()
    single = jax.sharding.SingleDeviceSharding
    host = single(device, memory_kind="pinned_host")
    on_device = single(device, memory_kind="device")
    size = (16 * 2**20) if args.smoke else 4 * GIB
    array = jax.device_put(jnp.ones((size // 4,), "float32"), on_device)
    rates: dict[str, list[float]] = {"device_to_host": [], "host_to_device": []}
    for _ in range(4):
        began = time.perf_counter()
        on_host = jax.block_until_ready(jax.device_put(array, host))
        middle = time.perf_counter()
        array = jax.block_until_ready(jax.device_put(on_host, on_device))
        ended = time.perf_counter()
        rates["device_to_host"].append(size / (middle - began) / 1e9)
        rates["host_to_device"].append(size / (ended - middle) / 1e9)
        del on_host
    return {
        "bytes": size,
        **{f"{way}_gb_s": statistics.median(r[1:]) for way, r in rates.items()},
    }


def plain(args: argparse.Namespace) -> dict[str, Any]:
    import keras  # noqa: PLC0415

    from keras_dist.planner.on_devices import shortfall_in  # noqa: PLC0415

    shape = _shape(args)
    out: dict[str, Any] = {"shape": shape}
    try:
        model = _build(shape)
        out["parameters"] = int(model.count_params())
        x, y = _data(shape, args.batch * 2, args.sequence)
        keras.Model.fit(model, x, y, batch_size=args.batch, epochs=1, verbose=0)
        out["out_of_memory"] = False
    except Exception as error:  # the out-of-memory is the figure
        text = f"{type(error).__name__}: {error}"
        needed, available = shortfall_in(text)
        out.update(
            out_of_memory="RESOURCE_EXHAUSTED" in text
            or "out of memory" in text.lower(),
            error=text[:3000],
            xla_needed_bytes=needed,
            xla_available_bytes=available,
        )
    out.update(_memory())
    return out


def _proposal(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    import keras_dist as kd  # noqa: PLC0415

    try:
        results = kd.plan_search(
            lambda: _build(shape),
            topology="local",
            batch_size=args.batch,
            sequence_length=args.sequence,
            time_budget=args.search_budget,
        )
    except (ValueError, TypeError) as error:
        return {"error": f"plan_search(topology='local') not available: {error}"}
    best = results.best
    table = [
        {
            "description": result.description,
            "status": result.status,
            "fits": None if result.compiled is None else result.compiled.fits,
            "peak_bytes": None
            if result.compiled is None
            else result.compiled.peak_bytes,
            "seconds": result.seconds,
        }
        for result in results
    ]
    if best is None:
        return {"error": "no candidate fits", "candidates": table}
    return {
        "best": best.description,
        "distribution": repr(best.distribution),
        "planned_peak_bytes": best.compiled.peak_bytes,
        "planned_host_peak_bytes": best.compiled.host_peak_bytes,
        "planned_host_traffic_bytes": best.compiled.host_traffic_bytes,
        "candidates": table,
        "_distribution": best.distribution,
    }


def kd_phase(args: argparse.Namespace) -> dict[str, Any]:
    import keras  # noqa: PLC0415

    import keras_dist as kd  # noqa: PLC0415

    shape = _shape(args)
    started = time.perf_counter()
    proposal = _proposal(args, shape)
    out: dict[str, Any] = {
        "shape": shape,
        "search_s": time.perf_counter() - started,
        "plan_search": {k: v for k, v in proposal.items() if not k.startswith("_")},
    }
    distribution = proposal.get("_distribution")
    if distribution is None:
        return out
    from benchmarks.harness import EpochTimer  # noqa: PLC0415 (imports keras)

    tokens = args.batch * args.sequence
    for accumulation in (1, 4):
        run: dict[str, Any] = {}
        out[f"accumulation_{accumulation}"] = run
        try:
            model = _build(shape, accumulation)
            x, y = _data(shape, args.batch * args.steps, args.sequence)
            times = EpochTimer()
            keras.Model.fit(
                model,
                x,
                y,
                batch_size=args.batch,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[kd.DistributeCallback(distribution), times],
            )
        except Exception as error:  # reported, never guessed
            run["error"] = f"{type(error).__name__}: {error}"[:3000]
            break
        step = times.seconds[-1] / args.steps
        run.update(
            ms_per_step=1e3 * step,
            tokens_per_s=tokens / step,
            first_epoch_s=times.seconds[0],
            parameters=int(model.count_params()),
            **_memory(),
        )
        host = [
            v
            for v in model.optimizer.variables
            if getattr(v.value.sharding, "memory_kind", None) == "pinned_host"
        ]
        run["host_state_bytes"] = int(sum(v.value.nbytes for v in host))
        traffic = proposal.get("planned_host_traffic_bytes")
        if traffic and accumulation == 1:
            run["host_link_gb_s_each_way_at_least"] = traffic / 2 / step / 1e9
        del model
        gc.collect()
    return out


PHASES = {"probe": probe, "plain": plain, "kd": kd_phase}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=list(PHASES))
    parser.add_argument("--phases", default="probe,plain,kd")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--search-budget", type=float, default=180.0)
    parser.add_argument("--phase-timeout", type=float, default=900.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if args.phase:  # one phase, in this process
        result = PHASES[args.phase](args)
        print("PHASE " + json.dumps(result, default=str), flush=True)
        return
    out: dict[str, Any] = {
        "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "config": {k: str(v) for k, v in vars(args).items()},
    }
    for name in args.phases.split(","):
        command = [sys.executable, __file__, "--phase", name, *_strip()]
        try:
            completed = subprocess.run(
                command, capture_output=True, text=True, timeout=args.phase_timeout
            )
        except subprocess.TimeoutExpired:
            out[name] = {"error": f"did not end within {args.phase_timeout:.0f} s"}
            continue
        lines = [
            line for line in completed.stdout.splitlines() if line.startswith("PHASE ")
        ]
        out[name] = (
            json.loads(lines[-1][len("PHASE ") :])
            if lines
            else {
                "error": f"exit {completed.returncode}",
                "log": (completed.stdout + completed.stderr)[-3000:],
            }
        )
    probe_rate = (out.get("probe") or {}).get("host_to_device_gb_s")
    for accumulation in ("accumulation_1",):
        run = (out.get("kd") or {}).get(accumulation) or {}
        rate = run.get("host_link_gb_s_each_way_at_least")
        if rate and probe_rate:
            run["host_link_vs_probe"] = rate / probe_rate
    text = json.dumps(out, indent=1, default=str)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text)


def _strip() -> list[str]:
    """This command's arguments without --phases and --json and their values."""
    kept, skip = [], False
    for argument in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if argument in ("--phases", "--json"):
            skip = True
            continue
        if argument.startswith(("--phases=", "--json=")):
            continue
        kept.append(argument)
    return kept


if __name__ == "__main__":
    main()
