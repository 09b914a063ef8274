"""Peak host memory of a few training steps of a wide MLP, with and without FSDP.

Feeds the "largest model that trains on this machine" estimate of the FSDP
entries (see `benchmarks/README.md`): it trains an MLP of `--layers` square
`Dense(--width)` layers (Adam, batch 64) for a few steps under
`kd.DataParallel()`, `kd.FSDP()` (which keeps the optimizer's state split
between calls; `--policy fsdp_keep` says so explicitly),
`kd.FSDP(keep_optimizer_sharded=False)` (`--policy fsdp_gather`), either
with activation checkpointing (`remat="full"`: `--policy fsdp_remat`,
`fsdp_keep_remat`) or (JAX only, `--policy native`) Keras' own
`ModelParallel` with the layouts `kd.FSDP` would give, or (PyTorch only,
`--policy native`) a plain torch MLP of the same shape under FSDP2's
`fully_shard` (per Linear and the root; `--no-reshard-after-forward` keeps
each layer's gathered weights until its backward) with `torch.optim.Adam`, or
(`--policy native_keras_layout`) the same with each layer's kernel laid out as
Keras' `Dense` holds it, (in, out), so that both run the same GEMMs (on CPU
MKL keeps GEMM buffers sized by them: `--free-mkl-buffers` under `--compare`
runs every job with `MKL_DISABLE_FAST_MM=1`), and prints, as JSON, the
parameter count and, per parameter, how much more the process held at its
peak than before the model was built:

- `peak_growth_bytes_per_param`: resident memory (VmHWM), the whole run
  (build, fit, the fit's end);
- `peak_allocated_growth_bytes_per_param`: what malloc had handed out
  (glibc's `mallinfo2`, sampled every 0.2 ms by a thread), the whole run:
  the bytes really held, where resident memory also counts the freed pages
  glibc keeps (below);
- `step_peak_growth_bytes_per_param`: resident memory during the steps after
  the first (the peak is reset, by `/proc/self/clear_refs`, when the first
  step ends), leaving out what a `fit` does once;
- `backward_start_growth_bytes_per_param`: what malloc had handed out when
  each step's backward starts (a hook on the gradient of the model's
  outputs), the largest over the steps: what is kept from the forward for the
  backward.

Before `before` is read, the same path runs once on a small model
(`--no-warm-up` leaves it out): the first model of a process costs about
440 MB resident whatever its size (torch's and Keras' lazily loaded modules
and kernels, the process groups), 17 bytes per parameter of the default
model, which would otherwise count as if it grew with the model. On JAX the N
simulated devices are one process, so this is the memory of all N together;
on PyTorch each process is one device and reports its own.

`--compare` (PyTorch) runs `--policies` in 2-process jobs, interleaved
`--repeats` times, once with glibc's default malloc and once with
`MALLOC_MMAP_THRESHOLD_=131072` (every block of 128 KiB or more its own
mapping, returned when freed: resident memory then follows what is
allocated), and prints the medians and ranges.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/fsdp_memory.py --policy fsdp
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/fsdp_memory.py --policy fsdp
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/fsdp_memory.py --policy native
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/fsdp_memory.py --compare --repeats 3
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
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
    stays resident and sets the floor of the steps' peak. The peak so far
    is kept in `_PEAK_BEFORE_RESETS` (see `whole_peak`)."""
    _PEAK_BEFORE_RESETS[0] = max(_PEAK_BEFORE_RESETS[0], status_bytes("VmHWM"))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")


_PEAK_BEFORE_RESETS = [0]


def start_whole_peak() -> None:
    """Reset the peak resident memory now; `whole_peak()` is then the peak
    from here on, across the resets that `reset_peak` does meanwhile."""
    reset_peak()
    _PEAK_BEFORE_RESETS[0] = 0


def whole_peak() -> int:
    return max(_PEAK_BEFORE_RESETS[0], status_bytes("VmHWM"))


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


class AllocatedPeak:
    """The most `allocated_bytes()` seen from `start()` to `stop()`, read
    every 0.2 ms by a thread (torch's kernels release the GIL): what the
    process really held at its peak, which resident memory overstates by
    the pages malloc keeps (see `benchmarks/README.md`). Sampled, so a
    peak shorter than a sample can be missed; it never counts more than was
    allocated."""

    def __init__(self) -> None:
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, allocated_bytes())
            time.sleep(0.0002)

    def start(self) -> AllocatedPeak:
        self.most = allocated_bytes()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.most = max(self.most, allocated_bytes())
        return self.most


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


def _in_out_linear(fan_in: int, units: int) -> Any:
    """A torch layer laid out as Keras' `Dense`: a kernel of shape (in, out)
    and `x @ kernel + bias`, where `torch.nn.Linear` holds (out, in) and
    computes `x @ weight.T`. The same GEMMs as the Keras model run (on CPU,
    MKL keeps packing buffers between calls whose size depends on the
    operands' layout: `benchmarks/README.md`), and `fully_shard` splits the
    kernel along its input dimension, as `kd.FSDP` does."""
    import torch

    class InOutLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            bound = 1 / fan_in**0.5
            self.kernel = torch.nn.Parameter(
                torch.empty(fan_in, units).uniform_(-bound, bound)
            )
            self.bias = torch.nn.Parameter(torch.zeros(units))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.kernel + self.bias

    return InOutLinear()


def fit_native(
    args: argparse.Namespace,
    x: np.ndarray,
    y: np.ndarray,
    reshard: bool,
    keras_layout: bool = False,
) -> tuple[int, int, int]:
    """A few steps of the same MLP as a plain torch module under FSDP2's
    `fully_shard`, each process on its share of every batch of `BATCH` rows;
    returns the parameter count, the steps' peak (`StepPeak`'s) and
    `BackwardStart`'s figure. `keras_layout`: its layers hold their kernels
    as Keras' `Dense` does (`_in_out_linear`) instead of `torch.nn.Linear`."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = args.width
    linear = _in_out_linear if keras_layout else torch.nn.Linear
    modules: list[torch.nn.Module] = []
    for _ in range(args.layers):
        modules += [linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*modules, linear(width, 10))
    params = sum(p.numel() for p in model.parameters())
    backward = BackwardStart(model)
    mesh = init_device_mesh("cpu", (kd.num_processes(),))
    for module in model:
        if not isinstance(module, torch.nn.ReLU):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    local = BATCH // kd.num_processes()
    for step in range(args.steps):
        start = step * BATCH + kd.process_id() * local
        inputs = torch.from_numpy(x[start : start + local, :width])
        targets = torch.from_numpy(y[start : start + local]).long()
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        if step == 0:
            reset_peak()
    return params, status_bytes("VmHWM"), backward.most


def fit_keras(
    args: argparse.Namespace, x: np.ndarray, y: np.ndarray, policy: str
) -> tuple[int, int, int | None]:
    """A few steps of `build(args)` under `policy` (`"dp"`, `"fsdp"`, or
    `"native"`: Keras' own ModelParallel, JAX); returns the parameter
    count, the steps' peak and `BackwardStart`'s figure (torch)."""
    fsdp = kd.FSDP(
        # `kd.FSDP()` as it comes keeps the optimizer's state split;
        # `fsdp_gather` gathers it when a call ends.
        keep_optimizer_sharded=not policy.startswith("fsdp_gather"),
        # Activation checkpointing: each Dense recomputed in backward.
        remat="full" if policy.endswith("_remat") else None,
    )
    native = None
    if policy == "native":
        native = keras.distribution.ModelParallel(
            layout_map=native_layout_map(fsdp, args), batch_dim_name=fsdp.axis
        )
        keras.distribution.set_distribution(native)
    model = build(args)
    backward = BackwardStart(model) if keras.backend.backend() == "torch" else None
    if native is None:
        callbacks = [
            kd.DistributeCallback(
                fsdp if policy.startswith("fsdp") else kd.DataParallel()
            )
        ]
    else:
        callbacks = []
    # A per-batch callback keeps batch ends synchronous: clear of the XLA CPU
    # rendezvous stall of a plain fit on simulated devices (README).
    step_peaks = StepPeak()
    callbacks += [StepTimer(), step_peaks]
    model.fit(
        x[: BATCH * args.steps, : args.width],
        y[: BATCH * args.steps],
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    if native is not None:
        keras.distribution.set_distribution(None)
    return (
        model.count_params(),
        step_peaks.peak,
        backward.most if backward is not None else None,
    )


def run_once(args: argparse.Namespace) -> dict:
    """One measurement in this process (see the module docstring)."""
    backend = keras.backend.backend()
    if args.policy == "native_keras_layout" and backend != "torch":
        raise ValueError(
            "--policy native_keras_layout is fully_shard on PyTorch. Received: "
            f"backend {backend!r}"
        )
    if args.policy == "native" and backend not in ("jax", "torch"):
        raise ValueError(
            "--policy native is Keras' own ModelParallel on JAX or "
            f"fully_shard on PyTorch. Received: backend {backend!r}"
        )
    if backend == "torch":
        kd.initialize()
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * args.steps,)).astype("int32")
    native_torch = args.policy.startswith("native") and backend == "torch"

    def fit(sizes: argparse.Namespace) -> tuple[int, int, int | None]:
        if native_torch:
            return fit_native(
                sizes, x, y, args.reshard, args.policy == "native_keras_layout"
            )
        return fit_keras(sizes, x, y, args.policy)

    if args.warm_up:
        # What the first model of a process costs whatever its size (torch's
        # and Keras' lazily loaded modules and kernels, the process groups:
        # about 440 MB resident for the first Keras model on torch, 17 bytes
        # per parameter of the default model) is paid here, on a small model
        # through the same path, so the figures below grow with the model.
        fit(argparse.Namespace(width=64, layers=2, steps=2))
        import gc

        gc.collect()
    start_whole_peak()
    before = resident_bytes()
    allocated_before = allocated_bytes()
    whole_run = AllocatedPeak().start()
    params, step_peak, backward_start = fit(args)
    allocated_peak = whole_run.stop()
    # Without the warm-up the process' peak since it started (`ru_maxrss`),
    # as before 2026-12-02; with it the peak since `before`.
    peak = whole_peak() if args.warm_up else peak_resident_bytes()
    return {
        "backend": backend,
        "devices": len(kd.list_devices()),
        "process": kd.process_id(),
        "processes": kd.num_processes(),
        "policy": args.policy
        + ("_no_reshard" if native_torch and not args.reshard else ""),
        "params": params,
        "warm_up": args.warm_up,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "mkl_disable_fast_mm": os.environ.get("MKL_DISABLE_FAST_MM"),
        "rss_before_build_bytes": before,
        "peak_rss_bytes": peak,
        "peak_growth_bytes_per_param": (peak - before) / params,
        "step_peak_rss_bytes": step_peak,
        "step_peak_growth_bytes_per_param": (step_peak - before) / params,
        "peak_allocated_growth_bytes_per_param": (allocated_peak - allocated_before)
        / params,
        "backward_start_growth_bytes_per_param": None
        if backward_start is None
        else (backward_start - allocated_before) / params,
    }


def compare(args: argparse.Namespace) -> None:
    """PyTorch: each of `--policies` in its own 2-process job (the launcher),
    interleaved `--repeats` times, with glibc's default malloc and with
    `MALLOC_MMAP_THRESHOLD_` fixed; per policy, the medians and ranges of
    each figure, the larger of the two processes' in each run."""
    figures = (
        "peak_growth_bytes_per_param",
        "peak_allocated_growth_bytes_per_param",
        "step_peak_growth_bytes_per_param",
        "backward_start_growth_bytes_per_param",
    )
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for malloc in ("default", "mmap_threshold_128k"):
            for policy in args.policies:
                env = dict(os.environ)
                env.pop("MALLOC_MMAP_THRESHOLD_", None)
                env.pop("MKL_DISABLE_FAST_MM", None)
                if args.free_mkl_buffers:
                    env["MKL_DISABLE_FAST_MM"] = "1"
                if malloc != "default":
                    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
                command = [
                    sys.executable, "-m", "keras_dist", "launch",
                    "--nproc-per-node", str(args.nproc), __file__,
                    "--policy", policy, "--width", str(args.width),
                    "--layers", str(args.layers), "--steps", str(args.steps),
                ]  # fmt: skip
                done = subprocess.run(
                    command, capture_output=True, text=True, env=env, check=False
                )
                if done.returncode:
                    raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
                results = [
                    json.loads(line[line.index("{") :])
                    for line in done.stdout.splitlines()
                    if '{"backend"' in line
                ]
                worst = {
                    figure: max(result[figure] for result in results)
                    for figure in figures
                }
                runs.setdefault((malloc, policy), []).append({**results[0], **worst})
    for (malloc, policy), results in runs.items():
        summary = {
            "malloc": malloc,
            "mkl_buffers": "freed" if args.free_mkl_buffers else "kept",
            "policy": policy,
            "params": results[0]["params"],
            "processes": results[0]["processes"],
            "runs": len(results),
        }
        for figure in figures:
            values = [result[figure] for result in results]
            summary[figure] = round(statistics.median(values), 2)
            summary[figure.replace("_bytes_per_param", "_range")] = [
                round(min(values), 2),
                round(max(values), 2),
            ]
        print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        choices=(
            "dp",
            "fsdp",
            "fsdp_keep",
            "fsdp_gather",
            "fsdp_remat",
            "fsdp_keep_remat",
            "native",
            "native_keras_layout",
        ),
        help="fsdp: kd.FSDP() as it comes (the optimizer's state kept split); "
        "fsdp_keep: the same, said explicitly; fsdp_gather: "
        "kd.FSDP(keep_optimizer_sharded=False); native: on JAX "
        "Keras' ModelParallel with kd.FSDP's layouts, set before the model is "
        "built; on PyTorch a torch MLP under fully_shard; native_keras_layout "
        "(PyTorch): the same with each layer's kernel laid out as Keras' Dense's, "
        "(in, out), computing x @ kernel + bias",
    )
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard",
        action="store_false",
        help="PyTorch --policy native: fully_shard(reshard_after_forward=False)",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="measure from the process' start: the first model's one-time costs "
        "count as if they grew with the model (the figures before 2026-12-02)",
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="PyTorch: run --policies in 2-process jobs, interleaved, twice each "
        "(default malloc, fixed mmap threshold); print medians and ranges",
    )
    parser.add_argument(
        "--policies", nargs="+", default=["fsdp", "fsdp_gather", "native", "dp"]
    )
    parser.add_argument(
        "--free-mkl-buffers",
        action="store_true",
        help="--compare: run every job with MKL_DISABLE_FAST_MM=1 (MKL frees "
        "its GEMM packing buffers after each call instead of keeping them)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    if args.policy is None:
        raise ValueError("Pass --policy dp|fsdp|native, or --compare.")
    if not args.reshard and (
        not args.policy.startswith("native") or keras.backend.backend() != "torch"
    ):
        raise ValueError(
            "--no-reshard-after-forward applies to fully_shard only: use it with "
            "--policy native on PyTorch. Received: --policy "
            f"{args.policy} on {keras.backend.backend()}"
        )
    print(json.dumps(run_once(args)), flush=True)


if __name__ == "__main__":
    main()
