"""Every JAX feature of keras_dist on the accelerator at hand, in one process.

Each check trains small models through keras_dist on the mesh of this
process' devices (one chip: a one-device mesh) and compares with plain Keras
on the same device, or with an uninterrupted run; it prints one table (what
ran, what it measured, pass or fail) and, with `--json`, writes it. Matrix
products run at `highest` precision for the comparisons (at JAX's default
an accelerator multiplies float32 in bfloat16 passes: two programs that are
the same training would differ by the rounding of differently fused
products). The checks:

- `data_parallel`: `kd.DataParallel` `fit` equals plain Keras' (weights), and
  over `fit`, `evaluate`, `predict`, `fit` again and `evaluate` again each
  step function compiles once (and no more programs than plain Keras).
- `model_parallel`, `fsdp`: `kd.ModelParallel` with a `LayoutMap` on a
  (batch, model) mesh and `kd.FSDP()`, equal to plain Keras; `fsdp_scope`: a
  model built under `kd.FSDP().scope()`.
- `checkpoint_resume`: `kd.Checkpoint` saves while fitting, a fit cut short
  (an exception as an epoch ends: no process killed) resumes from the latest
  checkpoint and ends exactly as the uninterrupted fit; `kd.restore` into a
  new model reads the same weights.
- `throughput`: `kd.callbacks.Throughput` logs samples/s and an MFU from the
  device kind's peak (`keras_dist.common.accelerators`).
- `remat`: `kd.DataParallel(remat="full")` equals the same fit without.
- `batch_norm`: global-batch BatchNormalization (an uneven last batch,
  padded and masked) equals plain Keras.
- `mixed_precision`: a `mixed_bfloat16` fit next to plain Keras' (bfloat16
  rounding: the gap is reported, the check is that it is small and finite).
- `uneven_predict`: `predict` of a batch count that pads returns plain
  Keras' predictions, one row per input row.
- `planner`: `kd.plan` reads the device's memory from the engine.

```shell
KERAS_BACKEND=jax python benchmarks/accelerator_features.py --json features.json
```

Not here: multi-process jobs (`jax.distributed` needs sockets between the
processes), which the test suite proves on CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

COMPILES: list[str] = []


def _listen(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(str(kwargs.get("fun_name", "")))


jax.monitoring.register_event_duration_secs_listener(_listen)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402

SEED = 7
BATCH = 64
TOLERANCE = 1e-5


def _data(rows: int = 320, features: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int32")
    return x, y


def _mlp(*, batch_norm: bool = False, dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    layers: list[Any] = [keras.Input((32,)), keras.layers.Dense(128, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(0.2))
    layers += [
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ]
    model = keras.Sequential(layers, name="mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _fit(model: keras.Model, callbacks: list, *, epochs: int = 3, **kwargs: Any) -> Any:
    x, y = _data(kwargs.pop("rows", 320))
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **kwargs,
    )


def _max_gap(first: keras.Model, second: keras.Model) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(first.get_weights(), second.get_weights(), strict=True)
    )


def _against_plain(
    distribution: Any, build: Callable[[], keras.Model] = _mlp, **fit: Any
) -> dict[str, Any]:
    plain = build()
    _fit(plain, [], **fit)
    model = build()
    _fit(model, [kd.DistributeCallback(distribution)], **fit)
    gap = _max_gap(plain, model)
    return {"ok": gap <= TOLERANCE, "max_weight_gap": gap}


# -- the checks -----------------------------------------------------------------
def data_parallel() -> dict[str, Any]:
    result = _against_plain(kd.DataParallel())
    x, y = _data()

    def count(make: Callable[[], list]) -> dict[str, int]:
        model = _mlp()
        before = len(COMPILES)
        _fit(model, make(), epochs=2, validation_data=(x[:64], y[:64]))
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=make())
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=make())
        _fit(model, make(), epochs=2)
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=make())
        seen = COMPILES[before:]
        counts = {
            step: sum(step in name for name in seen)
            for step in ("train_step", "test_step", "predict_step")
        }
        counts["all"] = len(seen)
        return counts

    # Plain Keras first: the small programs both run (a metric's result...)
    # are compiled by then, so keras_dist's count is its steps' and its own.
    plain = count(list)
    distribution = kd.DataParallel()
    ours = count(lambda: [kd.DistributeCallback(distribution)])
    result["compiles_plain"] = plain
    result["compiles_keras_dist"] = ours
    once = all(ours[step] == 1 for step in ("train_step", "test_step", "predict_step"))
    result["ok"] = result["ok"] and once and ours["all"] <= plain["all"]
    return result


def model_parallel() -> dict[str, Any]:
    devices = kd.list_devices()
    mesh = kd.DeviceMesh((len(devices), 1), ["batch", "model"], devices=devices)
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense.*bias"] = ("model",)
    return _against_plain(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )


def fsdp() -> dict[str, Any]:
    return _against_plain(kd.FSDP(min_size=0))


def fsdp_scope() -> dict[str, Any]:
    distribution = kd.FSDP(min_size=0)
    plain = _mlp()
    _fit(plain, [])
    with distribution.scope():
        model = _mlp()
    _fit(model, [kd.DistributeCallback(distribution)])
    gap = _max_gap(plain, model)
    return {"ok": gap <= TOLERANCE, "max_weight_gap": gap}


class _CutAt(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"cut as epoch {epoch} ends")


def checkpoint_resume() -> dict[str, Any]:
    distribution = kd.DataParallel()
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as cut:
        started = time.perf_counter()
        reference = _mlp(dropout=True)
        keras.utils.set_random_seed(SEED)
        _fit(
            reference,
            [kd.DistributeCallback(distribution), kd.Checkpoint(whole, save_freq=2)],
            epochs=3,
        )
        whole_s = time.perf_counter() - started
        first = _mlp(dropout=True)
        keras.utils.set_random_seed(SEED)
        try:
            _fit(
                first,
                [
                    kd.DistributeCallback(distribution),
                    kd.Checkpoint(cut, save_freq=2),
                    _CutAt(1),
                ],
                epochs=3,
            )
        except KeyboardInterrupt:
            pass
        resumed = _mlp(dropout=True)
        keras.utils.set_random_seed(SEED)
        _fit(
            resumed,
            [kd.DistributeCallback(distribution), kd.Checkpoint(cut, save_freq=2)],
            epochs=3,
        )
        restored = _mlp(dropout=True)
        kd.restore(restored, whole)
        resume_gap = _max_gap(reference, resumed)
        restore_gap = _max_gap(reference, restored)
        return {
            "ok": resume_gap == 0.0 and restore_gap == 0.0,
            "resume_weight_gap": resume_gap,
            "restore_weight_gap": restore_gap,
            "fit_with_checkpoints_s": round(whole_s, 2),
        }


def throughput() -> dict[str, Any]:
    if jax.devices()[0].platform == "cpu":
        return {"skip": "CPUs have no peak FLOP/s (no MFU)"}
    model = _mlp()
    history = _fit(
        model,
        [
            kd.DistributeCallback(kd.DataParallel()),
            kd.callbacks.Throughput(batch_size=BATCH, verbose=0),
        ],
        rows=64 * 40,
    )
    logs = {key: values[-1] for key, values in history.history.items()}
    mfu = logs.get("mfu")
    return {
        "ok": mfu is not None and 0 < mfu < 1,
        "device_kind": jax.devices()[0].device_kind,
        "samples_per_second": round(float(logs.get("samples_per_second", 0)), 1),
        "mfu": mfu,
    }


def remat() -> dict[str, Any]:
    without = _mlp()
    _fit(without, [kd.DistributeCallback(kd.DataParallel())])
    model = _mlp()
    _fit(model, [kd.DistributeCallback(kd.DataParallel(remat="full"))])
    gap = _max_gap(without, model)
    return {"ok": gap <= TOLERANCE, "max_weight_gap": gap}


def batch_norm() -> dict[str, Any]:
    return _against_plain(kd.DataParallel(), lambda: _mlp(batch_norm=True), rows=300)


def mixed_precision() -> dict[str, Any]:
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        result = _against_plain(kd.DataParallel())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # The same program on the same device: bfloat16 rounds alike.
    result["ok"] = bool(np.isfinite(result["max_weight_gap"])) and (
        result["max_weight_gap"] <= 1e-2
    )
    return result


def uneven_predict() -> dict[str, Any]:
    model = _mlp()
    x, _ = _data(300)
    plain = model.predict(x, batch_size=BATCH, verbose=0)
    ours = model.predict(
        x,
        batch_size=BATCH,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    gap = float(np.max(np.abs(plain - ours)))
    return {
        "ok": ours.shape == plain.shape and gap <= TOLERANCE,
        "rows": int(ours.shape[0]),
        "max_gap": gap,
    }


def planner() -> dict[str, Any]:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return {"skip": "JAX does not say a CPU's memory"}
    stats = device.memory_stats() or {}
    plan = kd.plan(_mlp(), kd.FSDP(min_size=0), batch_size=BATCH)
    memory = plan.devices[0].memory
    return {
        "ok": memory is not None and memory == stats.get("bytes_limit", memory),
        "planned_device_memory_gib": None if memory is None else memory / 2**30,
        "engine_bytes_limit_gib": (
            None if "bytes_limit" not in stats else stats["bytes_limit"] / 2**30
        ),
        "problems": [problem.kind for problem in plan.problems],
    }


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    check.__name__: check
    for check in (
        data_parallel,
        model_parallel,
        fsdp,
        fsdp_scope,
        checkpoint_resume,
        throughput,
        remat,
        batch_norm,
        mixed_precision,
        uneven_predict,
        planner,
    )
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS)
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(
        f"JAX {jax.__version__}, Keras {keras.__version__}, keras_dist "
        f"{kd.__version__}: {jax.device_count()} x {device.device_kind} "
        f"({device.platform})",
        flush=True,
    )
    results = []
    with jax.default_matmul_precision("highest"):
        for name in args.checks:
            started = time.perf_counter()
            try:
                result = CHECKS[name]()
            except Exception as error:  # reported in the table, the rest go on
                result = {
                    "ok": False,
                    "error": f"{type(error).__name__}: {error}"[:500],
                    "traceback": traceback.format_exc()[-2000:],
                }
            seconds = round(time.perf_counter() - started, 1)
            status = "SKIP" if "skip" in result else "PASS" if result["ok"] else "FAIL"
            result = {"check": name, "status": status, **result, "seconds": seconds}
            results.append(result)
            shown = {
                k: v
                for k, v in result.items()
                if k not in ("check", "status", "ok", "traceback")
            }
            print(f"{status} {name}: {shown}", flush=True)
            if "traceback" in result:
                print(result["traceback"], flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device_kind": device.device_kind,
                    "platform": device.platform,
                    "jax": jax.__version__,
                    "keras": keras.__version__,
                    "results": results,
                },
                indent=1,
            )
        )
    failed = [result["check"] for result in results if result["status"] == "FAIL"]
    passed = sum(result["status"] == "PASS" for result in results)
    print(
        f"{passed} passed, {len(failed)} failed, {len(results) - passed - len(failed)}"
        " skipped",
        flush=True,
    )
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
