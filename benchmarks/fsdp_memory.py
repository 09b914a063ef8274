"""Peak host memory of a few training steps of a wide MLP, with and without FSDP.

Feeds the "largest model that trains on this machine" estimate of the FSDP
entries (see `benchmarks/README.md`): it trains an MLP of `--layers` square
`Dense(--width)` layers (Adam, batch 64) for a few steps under
`kd.DataParallel()`, `kd.FSDP()` or (JAX only, `--policy native`) Keras' own
`ModelParallel` with the layouts `kd.FSDP` would give, or (PyTorch only,
`--policy native`) a plain torch MLP of the same shape under FSDP2's
`fully_shard` (per Linear and the root; `--no-reshard-after-forward` keeps
each layer's gathered weights until its backward) with `torch.optim.Adam`,
and prints, as JSON, the parameter count, the process' resident memory
before the model is built and its peak after the fit, and the peak growth per
parameter. It also reports the peak of the training steps after the first
(`step_peak_growth_bytes_per_param`: the peak resident memory is reset, by
`/proc/self/clear_refs`, when the first step ends), which leaves out what a
`fit` does once (building the optimizer, sharding at its start and gathering
at its end) and is the figure FSDP's sharding decides. And the bytes
malloc has handed out and not taken back (glibc's `mallinfo2`, exact where
resident memory keeps freed pages) when each step's backward starts (a hook
on the gradient of the model's outputs), the largest over the steps, as
`backward_start_growth_bytes_per_param`: what is kept from the forward for
the backward, where FSDP's whole weights (without resharding) pile up. On JAX the N
simulated devices are one process, so this is the memory of all N together;
on PyTorch each process is one device and reports its own.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/fsdp_memory.py --policy fsdp
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/fsdp_memory.py --policy fsdp
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/fsdp_memory.py --policy native
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import ctypes
import json
import resource
from typing import Any

import keras
import numpy as np

from benchmarks.harness import StepTimer

BATCH = 64


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"No {field} in /proc/self/status (this script needs Linux).")


def reset_peak() -> None:
    """Start `VmHWM` (the peak resident memory) again from the current
    resident memory (Linux >= 4.0; `ru_maxrss` cannot be reset), after
    returning the heap's free pages to the system (glibc's `malloc_trim`):
    otherwise memory freed since the start (the whole weights a fit shards)
    stays resident and sets the floor of the steps' peak."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")


def resident_bytes() -> int:
    return status_bytes("VmRSS")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
            "fordblks keepcost"
        ).split()
    ]


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not taken back, in every arena and
    mmap (glibc >= 2.33)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


class BackwardStart:
    """The most `allocated_bytes()` when a backward starts: a forward hook on
    the (torch) model makes its output's gradient hook read it. Registered
    before keras_dist's hooks, it sees this process' rows of the output."""

    def __init__(self, module: Any) -> None:
        self.most = 0
        module.register_forward_hook(self._forward)

    def _forward(self, module: Any, args: Any, output: Any) -> None:
        if getattr(output, "requires_grad", False):
            output.register_hook(self._backward)

    def _backward(self, grad: Any) -> None:
        self.most = max(self.most, allocated_bytes())


class StepPeak(keras.callbacks.Callback):
    """Resets the peak resident memory when the first training step ends and
    reads it when the last one ends (before the fit's own end)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch == 0:
            reset_peak()
        else:
            self.peak = status_bytes("VmHWM")


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


def fit_native(
    args: argparse.Namespace, x: np.ndarray, y: np.ndarray, reshard: bool
) -> tuple[int, int, int]:
    """A few steps of the same MLP as a plain torch module under FSDP2's
    `fully_shard`, each process on its share of every batch of `BATCH` rows;
    returns the parameter count, the steps' peak (`StepPeak`'s) and
    `BackwardStart`'s figure."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = args.width
    modules: list[torch.nn.Module] = []
    for _ in range(args.layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*modules, torch.nn.Linear(width, 10))
    params = sum(p.numel() for p in model.parameters())
    backward = BackwardStart(model)
    mesh = init_device_mesh("cpu", (kd.num_processes(),))
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    local = BATCH // kd.num_processes()
    for step in range(args.steps):
        start = step * BATCH + kd.process_id() * local
        inputs = torch.from_numpy(x[start : start + local])
        targets = torch.from_numpy(y[start : start + local]).long()
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        if step == 0:
            reset_peak()
    return params, status_bytes("VmHWM"), backward.most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        choices=("dp", "fsdp", "native"),
        required=True,
        help="native: on JAX Keras' ModelParallel with kd.FSDP's layouts, "
        "set before the model is built; on PyTorch a torch MLP under fully_shard",
    )
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard",
        action="store_false",
        help="PyTorch --policy native: fully_shard(reshard_after_forward=False)",
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not args.reshard and (
        args.policy != "native" or keras.backend.backend() != "torch"
    ):
        raise ValueError(
            "--no-reshard-after-forward applies to fully_shard only: use it with "
            "--policy native on PyTorch. Received: --policy "
            f"{args.policy} on {keras.backend.backend()}"
        )
    if keras.backend.backend() == "torch":
        kd.initialize()
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * args.steps,)).astype("int32")
    before = resident_bytes()
    allocated_before = allocated_bytes()
    fsdp = kd.FSDP()
    native = None
    if args.policy == "native" and keras.backend.backend() == "torch":
        params, step_peak, backward_start = fit_native(args, x, y, args.reshard)
    else:
        if args.policy == "native":
            if keras.backend.backend() != "jax":
                raise ValueError(
                    "--policy native is Keras' own ModelParallel on JAX or "
                    "fully_shard on PyTorch. Received: backend "
                    f"{keras.backend.backend()!r}"
                )
            native = keras.distribution.ModelParallel(
                layout_map=native_layout_map(fsdp, args), batch_dim_name=fsdp.axis
            )
            keras.distribution.set_distribution(native)
        model = build(args)
        backward = BackwardStart(model) if keras.backend.backend() == "torch" else None
        if native is None:
            callbacks = [
                kd.DistributeCallback(
                    fsdp if args.policy == "fsdp" else kd.DataParallel()
                )
            ]
        else:
            callbacks = []
        # A per-batch callback keeps batch ends synchronous: clear of the XLA CPU
        # rendezvous stall of a plain fit on simulated devices (README).
        step_peaks = StepPeak()
        callbacks += [StepTimer(), step_peaks]
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        params, step_peak = model.count_params(), step_peaks.peak
        backward_start = backward.most if backward is not None else None
    peak = peak_resident_bytes()
    print(
        json.dumps(
            {
                "backend": keras.backend.backend(),
                "devices": len(kd.list_devices()),
                "process": kd.process_id(),
                "processes": kd.num_processes(),
                "policy": args.policy
                + (
                    "_no_reshard"
                    if args.policy == "native" and not args.reshard
                    else ""
                ),
                "params": params,
                "rss_before_build_bytes": before,
                "peak_rss_bytes": peak,
                "peak_growth_bytes_per_param": (peak - before) / params,
                "step_peak_rss_bytes": step_peak,
                "step_peak_growth_bytes_per_param": (step_peak - before) / params,
                "backward_start_growth_bytes_per_param": None
                if backward_start is None
                else (backward_start - allocated_before) / params,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
