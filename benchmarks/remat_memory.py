"""Activation checkpointing (`remat=`): memory saved and step time paid.

Trains a deep residual MLP (`--blocks` blocks of `Dense(4 * width, gelu)` then
`Dense(width)` plus the block's input, a transformer's feed-forward half; Adam,
batch `--batch`) for a few steps under `kd.DataParallel()` or `kd.FSDP()`, with
and without `remat=` (`--remat full`: each block recomputed in the backward
pass, only its input kept; `dots`: its matrix products kept too; `offload`:
those kept in host memory), and prints one JSON line per run. `--model gemma` trains a
KerasHub Gemma decoder from its config instead (`--blocks` blocks of width
`--width`, `--sequence` tokens, random weights; each block has its
`Dropout(0.0)`s):

- `device_peak_bytes` (JAX on an accelerator): the device's peak,
  `peak_bytes_in_use` plus `peak_bytes_reserved` (the runtime keeps a
  program's temporaries apart), with and without remat in their own
  processes: the difference is what remat saves on the device.

- `backward_start_bytes` (PyTorch): what malloc holds when the backward
  starts, over what it held before the model was built (glibc's `mallinfo2`,
  exact): the weights, the optimizer and what the forward kept for the
  backward. Its difference between the two runs is the activation memory
  remat saves.
- `step_peak_bytes`: the peak resident memory of the steps after the first
  (reset when the first ends), over the resident memory before the build: on
  JAX the whole of the N simulated devices (one process), where XLA's buffers
  for the step are allocated.
- `xla_temp_bytes` (JAX): XLA's own figure for the temporary buffers of the
  compiled loss-and-gradient of one batch on one device (its memory analysis:
  exact, where the resident memory of XLA's CPU runtime hardly moves), with
  the layers' modes that remat gives them (what `fit` applies).
- `saved_device_bytes`, `saved_host_bytes` (JAX): what the loss-and-gradient
  of one batch keeps from the forward pass for the backward one (the
  residuals of `jax.vjp`, exact), on the device and in host memory.
- `step_ms`: the median step time (after `--skip-steps`), for the cost.

`--compare` runs each policy without remat and with each of `--remats` in its
own process (on PyTorch with `--processes N`, its own job of N processes under
`keras-dist launch`; the figures are then the largest of any process),
`--repeats` times, interleaved, and prints the medians and spreads of the
savings and the step-time ratio, one line per policy and remat.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/remat_memory.py --compare --policies dp fsdp
# the named policies
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    python benchmarks/remat_memory.py --compare --remats full dots offload
# a decoder on an accelerator (the TPU v5e chip): its peak memory
KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/remat_memory.py --compare \
    --model gemma --blocks 8 --width 1024 --sequence 1024 --batch 8 --repeats 1
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/remat_memory.py --compare
KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/remat_memory.py --compare \
    --processes 2 --policies dp fsdp
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import contextlib
import json
import os
import statistics
from collections.abc import Iterator

import keras
import numpy as np

from benchmarks.fsdp_memory import (
    BackwardStart,
    StepPeak,
    allocated_bytes,
    resident_bytes,
)
from benchmarks.harness import StepTimer, run_in_own_job


class Block(keras.layers.Layer):
    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, activation="gelu")
        self.down = keras.layers.Dense(width)

    def call(self, inputs):
        return inputs + self.down(self.up(inputs))


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    if args.model == "gemma":
        return build_gemma(args)
    inputs = keras.Input((args.width,))
    hidden = inputs
    for index in range(args.blocks):
        hidden = Block(args.width, name=f"block_{index}")(hidden)
    outputs = keras.layers.Dense(10, name="logits")(hidden)
    model = keras.Model(inputs, outputs, name="deep_mlp")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def build_gemma(args: argparse.Namespace) -> keras.Model:
    """A KerasHub Gemma decoder from its config (random weights, no download):
    `--blocks` decoder blocks of width `--width`, each with its
    `Dropout(0.0)`s, the layers remat once crashed on."""
    import keras_hub

    heads = max(1, args.width // 128)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=args.vocabulary,
        num_layers=args.blocks,
        num_query_heads=heads,
        num_key_value_heads=1,
        hidden_dim=args.width,
        intermediate_dim=4 * args.width,
        head_dim=args.width // heads,
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(args: argparse.Namespace, rows: int) -> tuple:
    rng = np.random.default_rng(0)
    if args.model == "gemma":
        tokens = rng.integers(0, args.vocabulary, (rows, args.sequence + 1))
        x = {
            "token_ids": tokens[:, :-1].astype("int32"),
            "padding_mask": np.ones((rows, args.sequence), "int32"),
        }
        return x, tokens[:, 1:].astype("int32")
    x = rng.normal(size=(rows, args.width)).astype("float32")
    return x, rng.integers(0, 10, size=(rows,)).astype("int32")


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def device_peak_bytes() -> int | None:
    """The accelerator's peak (JAX): `peak_bytes_in_use`, the buffers, plus
    `peak_bytes_reserved`, where the runtime keeps a program's temporaries.
    None on CPU devices, which keep no such count."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] + stats.get("peak_bytes_reserved", 0)


@contextlib.contextmanager
def recomputing(model: keras.Model, remat: str | None) -> Iterator[None]:
    """`model`'s layers recomputing as fit under keras_dist on JAX has them
    recompute with `remat` (a name or None)."""
    from keras_dist.backends.jax.remat import checkpoint
    from keras_dist.distribution.layer_settings import apply_layer_settings
    from keras_dist.keras_compat.layers import layers_of
    from keras_dist.keras_compat.remat import recompute_whole_calls

    # The layers' modes and policies, and recomputed calls whose Python
    # arguments stay static (Dropout's `training`) and whose state updates
    # leave the checkpoint as values.
    undo_modes = apply_layer_settings(
        model, kd.DataParallel(remat=remat), warn=False, recomputes_state=True
    )
    undo_calls = recompute_whole_calls(layers_of(model), checkpoint)
    try:
        yield
    finally:
        undo_calls()
        undo_modes()


def _loss_and_arguments(model: keras.Model, x, y) -> tuple:
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    metrics = [v.value for v in model.metrics_variables]
    optimizer = [v.value for v in model.optimizer.variables]

    def loss(trainable, non_trainable, x, y):
        value, _ = model.compute_loss_and_updates(
            trainable,
            non_trainable,
            metrics,
            x,
            y,
            None,
            training=True,
            optimizer_variables=optimizer,
        )
        return value

    return loss, (trainable, non_trainable, x, y)


def xla_temp_bytes(model: keras.Model, x, y, remat) -> int:
    """XLA's temporary bytes for the loss and gradients of `x`, `y` on one
    device, the layers recomputing as `remat` (a name or None) says."""
    import jax

    with recomputing(model, remat):
        loss, arguments = _loss_and_arguments(model, x, y)
        compiled = jax.jit(jax.grad(loss)).lower(*arguments).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)


def saved_bytes(model: keras.Model, x, y, remat) -> dict[str, int]:
    """The bytes the loss-and-gradient of `x`, `y` keeps from its forward pass
    for its backward one (the residuals of `jax.vjp`), by memory space
    (`"device"`, `"host"`), the layers recomputing as `remat` says."""
    import jax

    with recomputing(model, remat):
        loss, arguments = _loss_and_arguments(model, x, y)
        kept = jax.make_jaxpr(lambda *a: jax.vjp(loss, *a)[1])(*arguments)
    saved = {"device": 0, "host": 0}
    for aval in kept.out_avals:
        space = str(aval.memory_space).rsplit(".", 1)[-1].lower()
        saved[space] = saved.get(space, 0) + aval.size * aval.dtype.itemsize
    return saved


def run_once(args: argparse.Namespace) -> dict:
    if keras.backend.backend() == "torch":
        # Joins the job under `keras-dist launch` (--processes); alone otherwise.
        kd.initialize()
        import torch

        torch.set_num_threads(int(os.environ.get("REMAT_BENCH_THREADS", "2")))
    x, y = data(args, args.batch * args.steps)
    # On an accelerator the device's own peak is the figure; the host's
    # resident memory is not read (gVisor, say, keeps no VmHWM).
    host = keras.backend.backend() != "jax" or _on_cpu()
    before = resident_bytes() if host else 0
    allocated_before = allocated_bytes()
    remat = None if args.remat == "none" else args.remat
    distribution = (
        kd.FSDP(min_size=1024, remat=remat)
        if args.policy == "fsdp"
        else kd.DataParallel(remat=remat)
    )
    model = build(args)
    backward = BackwardStart(model) if keras.backend.backend() == "torch" else None
    timer, peak = StepTimer(), StepPeak() if host else None
    model.fit(
        x,
        y,
        batch_size=args.batch,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), timer, *[peak] * host],
    )
    temp = device_peak = None
    saved = {"device": None, "host": None}
    if keras.backend.backend() == "jax":
        device_peak = device_peak_bytes()  # before the analysis compiles more
        first = keras.tree.map_structure(lambda a: a[: args.batch], (x, y))
        temp = xla_temp_bytes(model, *first, remat)
        saved = saved_bytes(model, *first, remat)
    return {
        "model": args.model,
        "device_peak_bytes": device_peak,
        "xla_temp_bytes": temp,
        "saved_device_bytes": saved["device"],
        "saved_host_bytes": saved["host"],
        "backend": keras.backend.backend(),
        "devices": len(kd.list_devices()),
        "processes": kd.num_processes(),
        "policy": args.policy,
        "remat": remat,
        "params": model.count_params(),
        "backward_start_bytes": None
        if backward is None
        else backward.most - allocated_before,
        "step_peak_bytes": peak.peak - before if host else None,
        "step_ms": 1000 * statistics.median(timer.step_times(args.skip_steps)),
    }


def compare(args: argparse.Namespace) -> None:
    """Every policy without remat and with each of `--remats`, each run in its
    own process, interleaved `--repeats` times; the medians and spreads."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for policy in args.policies:
            for remat in ("none", *args.remats):
                arguments = ["--policy", policy, "--blocks", str(args.blocks)]
                arguments += ["--model", args.model]
                arguments += ["--sequence", str(args.sequence)]
                arguments += ["--vocabulary", str(args.vocabulary)]
                arguments += ["--width", str(args.width), "--batch", str(args.batch)]
                arguments += ["--steps", str(args.steps)]
                arguments += ["--skip-steps", str(args.skip_steps)]
                arguments += ["--remat", remat]
                env = dict(os.environ)
                if args.processes > 1:
                    # Each process on its own core; every process prints.
                    env.setdefault("REMAT_BENCH_THREADS", "1")
                runs.setdefault((policy, remat), []).append(
                    run_in_own_job(
                        __file__,
                        arguments,
                        args.processes,
                        most=(
                            "device_peak_bytes",
                            "backward_start_bytes",
                            "step_peak_bytes",
                            "xla_temp_bytes",
                        ),
                        env=env,
                    )
                )
    mib = 2**20
    for policy in args.policies:
        plain = runs[(policy, "none")]
        for name in args.remats:
            remat = runs[(policy, name)]
            key = next(
                k
                for k in ("device_peak_bytes", "backward_start_bytes", "xla_temp_bytes")
                if plain[0].get(k) is not None
            )
            saved = [(a[key] - b[key]) / mib for a, b in zip(plain, remat, strict=True)]
            ratio = [
                b["step_ms"] / a["step_ms"] for a, b in zip(plain, remat, strict=True)
            ]
            print(
                json.dumps(
                    {
                        "backend": plain[0]["backend"],
                        "model": args.model,
                        "devices": plain[0]["devices"],
                        "policy": policy,
                        "remat": name,
                        "params": plain[0]["params"],
                        "measure": key,
                        "without_remat_mib": statistics.median(
                            r[key] / mib for r in plain
                        ),
                        "with_remat_mib": statistics.median(
                            r[key] / mib for r in remat
                        ),
                        "saved_mib_median": statistics.median(saved),
                        "saved_mib_range": [min(saved), max(saved)],
                        "step_time_ratio_median": statistics.median(ratio),
                        "step_time_ratio_range": [min(ratio), max(ratio)],
                        "step_ms_without": statistics.median(
                            r["step_ms"] for r in plain
                        ),
                        "xla_temp_mib_without": _median_mib(plain, "xla_temp_bytes"),
                        "xla_temp_mib_with": _median_mib(remat, "xla_temp_bytes"),
                        "saved_device_mib_without": _median_mib(
                            plain, "saved_device_bytes"
                        ),
                        "saved_device_mib_with": _median_mib(
                            remat, "saved_device_bytes"
                        ),
                        "saved_host_mib_with": _median_mib(remat, "saved_host_bytes"),
                        "step_peak_mib_without": _median_mib(plain, "step_peak_bytes"),
                        "step_peak_mib_with": _median_mib(remat, "step_peak_bytes"),
                        "processes": args.processes,
                        "runs": args.repeats,
                    }
                )
            )


def _median_mib(runs: list[dict], key: str) -> float | None:
    if runs[0].get(key) is None:
        return None
    return statistics.median(r[key] / 2**20 for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("dp", "fsdp"), default="dp")
    parser.add_argument(
        "--remat", choices=("none", "full", "dots", "offload"), default="none"
    )
    parser.add_argument("--model", choices=("mlp", "gemma"), default="mlp")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=512, help="gemma only")
    parser.add_argument("--vocabulary", type=int, default=8192, help="gemma only")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-steps", type=int, default=2)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--policies", nargs="+", default=["dp"])
    parser.add_argument(
        "--remats",
        nargs="+",
        choices=("full", "dots", "offload"),
        default=["full"],
        help="with --compare: the remat settings each compared with none",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="with --compare on PyTorch: run each under `keras-dist launch` "
        "with this many processes (kd.FSDP shards over them)",
    )
    args = parser.parse_args()
    if args.compare:
        compare(args)
    else:
        print(json.dumps(run_once(args)), flush=True)


if __name__ == "__main__":
    main()
