"""One process of the GPU suite's PyTorch job (tests/gpu/test_torch_gpu.py),
started by `keras-dist launch --nproc-per-node N` (N = 1 or 2: two processes
share the one GPU over gloo, `KERAS_DIST_TORCH_BACKEND=gloo`).

Usage: python torch_gpu_worker.py OUTPUT_DIR SCENARIO[,SCENARIO...]
Writes OUTPUT_DIR/result-<rank>.json: each scenario's weights (flattened)
and what it saw.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as torch_distributed  # noqa: E402

SEED = 11
BATCH = 32


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return (
        rng.normal(size=(128, 16)).astype("float32"),
        rng.normal(size=(128, 4)).astype("float32"),
    )


def _model(jit_compile: bool = False) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="dense_1"),
            keras.layers.Dense(64, activation="relu", name="dense_2"),
            keras.layers.Dense(4, name="dense_3"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile
    )
    return model


def _weights(model: keras.Model) -> list[float]:
    return [
        float(value)
        for weight in model.get_weights()
        for value in np.asarray(weight, "float32").reshape(-1)
    ]


class _AllReduces:
    """Counts `torch.distributed.all_reduce` calls by the device of the
    tensor (keras_dist's gradient sync goes through it)."""

    def __init__(self) -> None:
        self.devices: dict[str, int] = {}
        self._original = torch_distributed.all_reduce

    def __enter__(self) -> _AllReduces:
        def counting(tensor, *args, **kwargs):
            kind = tensor.device.type
            self.devices[kind] = self.devices.get(kind, 0) + 1
            return self._original(tensor, *args, **kwargs)

        torch_distributed.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        torch_distributed.all_reduce = self._original


def _fit(model: keras.Model, distribution, callbacks=()) -> None:
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            *([kd.DistributeCallback(distribution)] if distribution else []),
            *callbacks,
        ],
    )


def plain(_: pathlib.Path) -> dict:
    model = _model()
    _fit(model, None)
    return {"weights": _weights(model)}


def dp(_: pathlib.Path) -> dict:
    model = _model()
    with _AllReduces() as counts:
        _fit(model, kd.DataParallel())
    return {
        "weights": _weights(model),
        "all_reduces": counts.devices,
        "weight_device": str(model.weights[0].value.device),
    }


def fsdp(_: pathlib.Path) -> dict:
    model = _model()
    _fit(model, kd.FSDP(min_size=0))
    return {"weights": _weights(model)}


def bf16(_: pathlib.Path) -> dict:
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = _model()
        _fit(model, kd.DataParallel())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {"weights": _weights(model)}


def remat(_: pathlib.Path) -> dict:
    model = _model()
    _fit(model, kd.DataParallel(remat="full"))
    return {"weights": _weights(model)}


def compiled(_: pathlib.Path) -> dict:
    model = _model(jit_compile=True)
    _fit(model, kd.DataParallel())
    return {"weights": _weights(model)}


def checkpoint(output: pathlib.Path) -> dict:
    directory = output / f"checkpoint-{kd.num_processes()}"
    model = _model()
    _fit(model, kd.DataParallel(), [kd.Checkpoint(directory, save_freq=2)])
    restored = _model()
    restored.build((None, 16))
    step = kd.restore(restored, directory)
    gap = max(
        abs(a - b) for a, b in zip(_weights(model), _weights(restored), strict=True)
    )
    return {"weights": _weights(model), "restored_step": step, "restore_gap": gap}


def oom(_: pathlib.Path) -> dict:
    """A step larger than the GPU's share this process may take
    (`torch.cuda.set_per_process_memory_fraction`): torch's CUDA
    out-of-memory error, raised as `kd.OutOfDeviceMemoryError`. Last: the cap
    stays for the rest of the process."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * 2**30 / total))
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [keras.Input((16384,)), keras.layers.Dense(16384), keras.layers.Dense(4)]
    )  # 268 M parameters: 1.07 GB, and Adam's moments twice that
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((64, 16384), "float32")
    y = np.zeros((64, 4), "float32")
    try:
        _fit_rows(model, x, y)
    except kd.OutOfDeviceMemoryError as error:
        return {
            "error": type(error).__name__,
            "cause": type(error.__cause__).__name__,
            "message": str(error)[:3000],
        }
    return {"error": None}


def _fit_rows(model: keras.Model, x: np.ndarray, y: np.ndarray) -> None:
    model.fit(
        x,
        y,
        batch_size=64,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )


SCENARIOS = {
    f.__name__: f for f in (plain, dp, fsdp, bf16, remat, compiled, checkpoint, oom)
}


def main() -> None:
    output = pathlib.Path(sys.argv[1])
    names = sys.argv[2].split(",")
    result: dict = {
        "rank": kd.process_id(),
        "processes": kd.num_processes(),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "process_group": (
            torch_distributed.get_backend()
            if torch_distributed.is_initialized()
            else None
        ),
        "cuda": torch.cuda.is_available(),
        "current_device": (
            torch.cuda.current_device() if torch.cuda.is_available() else None
        ),
        "device_count": torch.cuda.device_count(),
    }
    for name in names:
        result[name] = SCENARIOS[name](output)
    (output / f"result-{kd.process_id()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
