"""The optimizer's state in host memory (`offload="optimizer"`) and in
bfloat16 (`optimizer_state_dtype="bfloat16"`): memory saved, time paid,
accuracy kept. Prints JSON.

Modes (`--mode`, JAX):

- `step` (CPU, the default): `fit` of an MLP of `--layers` x Dense(`--width`)
  with Adam under `kd.DataParallel()` on the simulated devices, with and
  without offload, interleaved `--repeats` times in one process: ms a step
  of each and their ratio (the offloaded step's overhead; on CPU host and
  device memory are the same RAM, so this is the cost of the transfers'
  bookkeeping and ordering, not of a host link).
- `compiled`: the train step `fit` runs compiled for a TPU topology
  (`--topology`, default `v5e:1x1`, through `kd.plan(..., topology=)`; needs
  libtpu, no chip) for `--layers` x Dense(`--width`) fp32 Adam: XLA's device
  peak, arguments and temporaries per device, for the state on the device,
  offloaded, in bfloat16, and both.
- `chip` (on an accelerator): for each depth of `--depths`, `fit` of
  N x Dense(`--width`) fp32 Adam (batch `--batch`) with and without offload,
  each in the same process, an out-of-memory caught and reported: ms a step,
  the optimizer state moved each way a step, bytes/s of it, and the deepest
  stack each trains.
- `digits`: a small real fine-tune, scikit-learn's digits (8x8 images, 10
  classes) with an MLP, `--steps` Adam steps with float32 and with bfloat16
  state: final training loss and test accuracy of each, and the compiled
  train step's peak on `--topology` with each (when libtpu is present).

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. python benchmarks/offload.py
TPU_SKIP_MDS_QUERY=1 KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/offload.py \
    --mode compiled --layers 20 --width 8192
KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/offload.py --mode chip \
    --depths 16 20 24 32 36 40
KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/offload.py --mode digits
```
"""

from __future__ import annotations

import keras_dist as kd  # isort: skip  (applies KERAS_DIST_CPU_DEVICES first)

import argparse
import json
import re
import statistics
import time
from typing import Any

import jax
import keras
import numpy as np

GIB = 2**30


def _stack(layers: int, width: int, optimizer: Any = "adam") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, use_bias=False) for _ in range(layers)]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _timed_fit(model: keras.Model, distribution: Any, x: Any, y: Any, batch: int):
    """Seconds a step of `fit` over x (after a first `fit` that compiles)."""
    callbacks = [kd.DistributeCallback(distribution)]
    options = {"batch_size": batch, "shuffle": False, "verbose": 0}
    model.fit(x[: 2 * batch], y[: 2 * batch], callbacks=callbacks, **options)
    start = time.perf_counter()
    model.fit(x, y, callbacks=callbacks, **options)
    float(np.asarray(model.weights[0]).ravel()[0])  # waits for the last step
    return (time.perf_counter() - start) / (len(x) // batch)


def step_mode(args: argparse.Namespace) -> dict[str, Any]:
    rows = args.batch * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.normal(size=(rows, args.width)).astype("float32")
    models = {
        offload: _stack(args.layers, args.width) for offload in (None, "optimizer")
    }
    times: dict[Any, list[float]] = {None: [], "optimizer": []}
    for _ in range(args.repeats):
        for offload, model in models.items():
            distribution = kd.DataParallel(offload=offload)
            times[offload].append(_timed_fit(model, distribution, x, y, args.batch))
    plain = statistics.median(times[None])
    offloaded = statistics.median(times["optimizer"])
    gap = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(models[None].weights, models["optimizer"].weights, strict=True)
    )
    return {
        "mode": "step",
        "layers": args.layers,
        "width": args.width,
        "devices": len(kd.list_devices()),
        "ms_per_step": round(plain * 1e3, 2),
        "ms_per_step_offloaded": round(offloaded * 1e3, 2),
        "offloaded_over_plain": round(offloaded / plain, 3),
        "max_weight_difference": gap,
        "repeats": args.repeats,
    }


PLACEMENTS = {
    "device": {},
    "offload": {"offload": "optimizer"},
    "bfloat16": {"optimizer_state_dtype": "bfloat16"},
    "offload+bfloat16": {"offload": "optimizer", "optimizer_state_dtype": "bfloat16"},
}


def _compiled_peaks(
    make_model: Any, topology: str, batch: int, unit: str = "gib"
) -> dict[str, Any]:
    scale, digits = (GIB, 3) if unit == "gib" else (2**20, 2)
    out = {}
    for name, placement in PLACEMENTS.items():
        plan = kd.plan(
            make_model,
            lambda mesh, placement=placement: kd.DataParallel(mesh, **placement),
            topology=topology,
            batch_size=batch,
            steps=("train",),
        )
        step = plan.compiled.train
        if step.error:
            out[name] = {"error": step.error[:300]}
            continue
        out[name] = {
            f"peak_{unit}": round(step.peak_bytes / scale, digits),
            f"arguments_{unit}": round(step.argument_bytes / scale, digits),
            f"temporaries_{unit}": round(step.temp_bytes / scale, digits),
        }
    return out


def _host_copies(text: str) -> dict[str, int]:
    """The copies between host memory (`S(5)`) and the device in a compiled
    program (XLA's text), inside the branches of its conditionals and
    elsewhere."""
    branches = set()
    for names in re.findall(r"branch_computations=\{([^}]*)\}", text):
        branches.update(name.strip() for name in names.split(","))
    counts = {"in_conditional_branches": 0, "elsewhere": 0}
    computation = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
        elif " copy-start(" in line and "S(5)" in line:
            where = (
                "in_conditional_branches" if computation in branches else "elsewhere"
            )
            counts[where] += 1
    return counts


def compiled_mode(args: argparse.Namespace) -> dict[str, Any]:
    def model() -> keras.Model:
        optimizer = keras.optimizers.Adam(gradient_accumulation_steps=args.accumulation)
        return _stack(args.layers, args.width, optimizer)

    out = {
        "mode": "compiled",
        "topology": args.topology,
        "layers": args.layers,
        "width": args.width,
        "parameters": args.layers * args.width**2,
        "gradient_accumulation_steps": args.accumulation,
        "train_step": _compiled_peaks(model, args.topology, args.batch),
    }
    if args.accumulation:
        # Where the offloaded step moves the state: in the update step's
        # branch only, or on every micro-step.
        texts: list[str] = []
        compile_lowered = jax.stages.Lowered.compile

        def compile_and_keep(self: Any, *a: Any, **k: Any) -> Any:
            compiled = compile_lowered(self, *a, **k)
            texts.append(compiled.as_text())
            return compiled

        jax.stages.Lowered.compile = compile_and_keep
        try:
            kd.plan(
                model,
                lambda mesh: kd.DataParallel(mesh, offload="optimizer"),
                topology=args.topology,
                batch_size=args.batch,
                steps=("train",),
            )
        finally:
            jax.stages.Lowered.compile = compile_lowered
        out["offloaded_host_copies"] = _host_copies(texts[-1])
    return out


def _out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    return any(
        word in text
        for word in ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")
    )


def chip_mode(args: argparse.Namespace) -> dict[str, Any]:
    rows = args.batch * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.normal(size=(rows, args.width)).astype("float32")
    runs = []
    deepest: dict[str, int | None] = {"device": None, "offload": None}
    for depth in args.depths:
        for name in ("device", "offload"):
            run: dict[str, Any] = {"layers": depth, "state": name}
            run["parameters"] = depth * args.width**2
            try:
                model = _stack(depth, args.width)
                distribution = kd.DataParallel(**PLACEMENTS[name])
                seconds = _timed_fit(model, distribution, x, y, args.batch)
                moved = 2 * 4 * depth * args.width**2  # both moments, fp32
                run["ms_per_step"] = round(seconds * 1e3, 1)
                if name == "offload":
                    run["state_moved_each_way_gib"] = round(moved / GIB, 2)
                    run["gb_per_s_both_ways"] = round(2 * moved / seconds / 1e9, 1)
                deepest[name] = depth
            except Exception as error:  # XLA's runtime error types
                if not _out_of_memory(error):
                    raise
                run["error"] = "out of memory: " + str(error).splitlines()[0][:200]
            finally:
                keras.backend.clear_session()
            runs.append(run)
            print(json.dumps(run), flush=True)
    return {"mode": "chip", "width": args.width, "runs": runs, "deepest": deepest}


def digits_mode(args: argparse.Namespace) -> dict[str, Any]:
    from sklearn.datasets import load_digits  # noqa: PLC0415

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype("float32")
    labels = labels.astype("int32")
    split = 1440
    x, y, x_test, y_test = (
        images[:split],
        labels[:split],
        images[split:],
        labels[split:],
    )

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        made = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        made.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return made

    out: dict[str, Any] = {"mode": "digits", "steps": args.steps}
    epochs = max(1, args.steps * 32 // split)
    for name in ("device", "bfloat16"):
        trained = model()
        history = trained.fit(
            x,
            y,
            batch_size=32,
            epochs=epochs,
            shuffle=True,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel(**PLACEMENTS[name]))],
        )
        _, accuracy = trained.evaluate(x_test, y_test, verbose=0)
        out[name] = {
            "final_loss": round(history.history["loss"][-1], 5),
            "test_accuracy": round(float(accuracy), 4),
        }
    try:
        out["compiled"] = _compiled_peaks(model, args.topology, 32, unit="mib")
    except (RuntimeError, ValueError) as error:  # no libtpu here
        out["compiled"] = {"error": str(error)[:200]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode", choices=("step", "compiled", "chip", "digits"), default="step"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--accumulation", type=int, default=None)
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 20, 24, 32, 36])
    args = parser.parse_args()
    defaults = {
        "step": (512, 64, 20),
        "compiled": (8192, 8, 1),
        "chip": (8192, 8, 10),
        "digits": (0, 32, 450),
    }[args.mode]
    args.width = args.width or defaults[0]
    args.batch = args.batch or defaults[1]
    args.steps = args.steps or defaults[2]
    mode = {
        "step": step_mode,
        "compiled": compiled_mode,
        "chip": chip_mode,
        "digits": digits_mode,
    }[args.mode]
    print(json.dumps(mode(args)))


if __name__ == "__main__":
    main()
