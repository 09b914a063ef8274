"""Peak host memory of a few training steps of a wide MLP, with and without FSDP.

Feeds the "largest model that trains on this machine" estimate of the FSDP
entries (see `benchmarks/README.md`): it trains an MLP of `--layers` square
`Dense(--width)` layers (Adam, batch 64) for a few steps under
`kd.DataParallel()`, `kd.FSDP()` or (JAX only, `--policy native`) Keras' own
`ModelParallel` with the layouts `kd.FSDP` would give, and prints, as JSON,
the parameter count, the process' resident memory before the model is built
and its peak after the fit, and the peak growth per parameter. On JAX the N
simulated devices are one process, so this is the memory of all N together;
on PyTorch each process is one device and reports its own.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/fsdp_memory.py --policy fsdp
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/fsdp_memory.py --policy fsdp
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import json
import resource
from typing import Any

import keras
import numpy as np

from benchmarks.harness import StepTimer

BATCH = 64


def resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("No VmRSS in /proc/self/status (this script needs Linux).")


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [
            keras.layers.Dense(args.width, activation="relu", name=f"dense_{i}")
            for i in range(args.layers)
        ]
        + [keras.layers.Dense(10, name="logits")],
        name="wide_mlp",
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def native_layout_map(fsdp: kd.FSDP, args: argparse.Namespace) -> Any:
    """Keras' `LayoutMap` giving every variable kd.FSDP's layout (from shapes
    only: the probe model is never built)."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), [fsdp.axis], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    shapes = {f"dense_{i}": args.width for i in range(args.layers)}
    shapes["logits"] = 10
    for name, units in shapes.items():
        for suffix, shape in (("kernel", (args.width, units)), ("bias", (units,))):
            dim = fsdp.fsdp_dimension(name, shape, "float32", (None,) * len(shape))
            axes = [None] * len(shape)
            if dim is not None:
                axes[dim] = fsdp.axis
            layout_map[f"^wide_mlp/{name}/{suffix}$"] = tuple(axes)
    return layout_map


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        choices=("dp", "fsdp", "native"),
        required=True,
        help="native (JAX only): Keras' ModelParallel with kd.FSDP's layouts, "
        "set before the model is built",
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if keras.backend.backend() == "torch":
        kd.initialize()
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * args.steps,)).astype("int32")
    before = resident_bytes()
    fsdp = kd.FSDP()
    native = None
    if args.policy == "native":
        if keras.backend.backend() != "jax":
            raise ValueError(
                "--policy native is Keras' own ModelParallel, which this script "
                f"runs on JAX only. Received: backend {keras.backend.backend()!r}"
            )
        native = keras.distribution.ModelParallel(
            layout_map=native_layout_map(fsdp, args), batch_dim_name=fsdp.axis
        )
        keras.distribution.set_distribution(native)
    model = build(args)
    if native is None:
        callbacks = [
            kd.DistributeCallback(fsdp if args.policy == "fsdp" else kd.DataParallel())
        ]
    else:
        callbacks = []
    # A per-batch callback keeps batch ends synchronous: clear of the XLA CPU
    # rendezvous stall of a plain fit on simulated devices (README).
    callbacks.append(StepTimer())
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    peak = peak_resident_bytes()
    params = model.count_params()
    print(
        json.dumps(
            {
                "backend": keras.backend.backend(),
                "devices": len(kd.list_devices()),
                "process": kd.process_id(),
                "processes": kd.num_processes(),
                "policy": args.policy,
                "params": params,
                "rss_before_build_bytes": before,
                "peak_rss_bytes": peak,
                "peak_growth_bytes_per_param": (peak - before) / params,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
