"""keras_dist's JAX paths on a GPU, each against plain Keras on the same GPU.

One GPU is a mesh of one device: the distributions split nothing there (the
CPU suite proves the splitting on 8 simulated devices), but every path runs
on CUDA: the layouts, the compiled steps, the offloaded optimizer state in
the GPU's `pinned_host` memory, cuDNN's flash attention, the checkpoints and
the out-of-memory error under a real device limit. Matrix products run at
`highest` precision for the comparisons (at JAX's default a GPU multiplies
float32 in TF32: two programs that are the same training would differ by the
rounding of differently fused products).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.gpu.conftest import needs_cuda

pytestmark = pytest.mark.backend("jax")

SEED = 7
BATCH = 32
TOLERANCE = 1e-5
HERE = pathlib.Path(__file__).parent


@pytest.fixture(autouse=True)
def _highest_precision():
    import jax  # noqa: PLC0415

    with jax.default_matmul_precision("highest"):
        yield


def _data(rows: int = 128) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(rows, 32)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int32")
    return x, y


def _mlp(optimizer: Callable[[], Any] = lambda: keras.optimizers.Adam(1e-3)):
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu", name="dense_1"),
            keras.layers.Dense(64, activation="relu", name="dense_2"),
            keras.layers.Dense(10, name="dense_3"),
        ]
    )
    model.compile(
        optimizer=optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _fit(model: keras.Model, callbacks: list, epochs: int = 2, **kwargs) -> Any:
    x, y = _data()
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


def _gap(first: keras.Model, second: keras.Model) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a, "float32") - np.asarray(b, "float32"))))
        for a, b in zip(first.get_weights(), second.get_weights(), strict=True)
    )


def _plain_and(distribution: Any, build: Callable[[], keras.Model] = _mlp):
    plain = build()
    _fit(plain, [])
    model = build()
    _fit(model, [kd.DistributeCallback(distribution)])
    return plain, model


_COMPILES: list[str] = []


def _count_compiles() -> list[str]:
    import jax  # noqa: PLC0415

    if not _COMPILES:
        _COMPILES.append("listening")

        def listen(event: str, duration: float, **kwargs: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                _COMPILES.append(str(kwargs.get("fun_name", "")))

        jax.monitoring.register_event_duration_secs_listener(listen)
    return _COMPILES


def test_data_parallel_equals_plain_keras_and_compiles_each_step_once():
    plain, model = _plain_and(kd.DataParallel())
    assert _gap(plain, model) <= TOLERANCE
    compiles = _count_compiles()
    x, y = _data()

    def steps(callbacks: Callable[[], list]) -> dict[str, int]:
        model = _mlp()
        before = len(compiles)
        _fit(model, callbacks(), validation_data=(x[:32], y[:32]))
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks())
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks())
        _fit(model, callbacks())
        seen = compiles[before:]
        counts = {
            step: sum(step in name for name in seen)
            for step in ("train_step", "test_step", "predict_step")
        }
        counts["all"] = len(seen)
        return counts

    steps(list)  # the small programs both compile, compiled once here
    plain_counts = steps(list)
    distribution = kd.DataParallel()
    ours = steps(lambda: [kd.DistributeCallback(distribution)])
    assert {
        step: ours[step] for step in ("train_step", "test_step", "predict_step")
    } == {
        "train_step": 1,
        "test_step": 1,
        "predict_step": 1,
    }, ours
    # Plain Keras compiles its steps again for each new model: as many.
    assert ours["all"] <= plain_counts["all"] + 3, (ours, plain_counts)


def _model_parallel() -> kd.ModelParallel:
    devices = kd.list_devices()
    mesh = kd.DeviceMesh((len(devices), 1), ["batch", "model"], devices=devices)
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["dense.*bias"] = ("model",)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_fsdp_and_model_parallel_equal_plain_keras(kind):
    distribution = kd.FSDP(min_size=0) if kind == "fsdp" else _model_parallel()
    plain, model = _plain_and(distribution)
    assert _gap(plain, model) <= TOLERANCE


def _slots(model: keras.Model) -> list:
    return [
        v
        for v in model.optimizer.variables
        if v.name.endswith(("momentum", "velocity"))
    ]


def test_offloaded_optimizer_slots_live_in_pinned_host_and_train_alike():
    on_device = _mlp()
    _fit(on_device, [kd.DistributeCallback(kd.DataParallel())])
    model = _mlp()
    _fit(model, [kd.DistributeCallback(kd.DataParallel(offload="optimizer"))])
    assert _gap(on_device, model) <= 1e-6
    slots = _slots(model)
    assert len(slots) == 12  # Adam's two moments of 6 variables
    assert {v.value.sharding.memory_kind for v in slots} == {"pinned_host"}
    assert model.optimizer.iterations.value.sharding.memory_kind == "device"


def test_optimizer_state_dtype_keeps_the_slots_in_bfloat16():
    full = _mlp()
    _fit(full, [kd.DistributeCallback(kd.DataParallel())])
    model = _mlp()
    distribution = kd.DataParallel(
        offload="optimizer", optimizer_state_dtype="bfloat16"
    )
    _fit(model, [kd.DistributeCallback(distribution)])
    assert {str(v.value.dtype) for v in _slots(model)} == {"bfloat16"}
    # Rounded moments: close to the float32 run, not equal.
    assert _gap(full, model) <= 1e-2


@pytest.mark.parametrize("policy", ["full", "dots", "offload"])
def test_remat_policies_train_as_without(policy):
    without = _mlp()
    _fit(without, [kd.DistributeCallback(kd.DataParallel())])
    model = _mlp()
    _fit(model, [kd.DistributeCallback(kd.DataParallel(remat=policy))])
    assert _gap(without, model) <= TOLERANCE


def _attention_model(flash_attention) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    tokens = keras.Input((64,), dtype="int32")
    hidden = keras.layers.Embedding(128, 128)(tokens)
    # cuDNN's flash attention: 16-bit inputs, a head size that is a multiple
    # of 8 (here 64).
    attended = keras.layers.MultiHeadAttention(
        2, 64, flash_attention=flash_attention, name="attention"
    )(hidden, hidden, use_causal_mask=True)
    model = keras.Model(tokens, keras.layers.Dense(128)(hidden + attended))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _tokens() -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 128, (32, 64)).astype("int32")


def _sequence(shape: tuple[int, int]) -> kd.DataParallel:
    return kd.DataParallel(kd.DeviceMesh(shape, ["batch", "seq"]), sequence_axis="seq")


class _FlashChoice(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def on_train_batch_begin(self, batch, logs=None):
        from keras_dist.keras_compat.layers import (  # noqa: PLC0415
            flash_attention_choice,
        )

        self.seen.append(flash_attention_choice(self.model.get_layer("attention")))


def test_a_sequence_axis_of_one_keeps_cudnns_flash_attention():
    needs_cuda("cuDNN's flash attention")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x = _tokens()
        plain = _attention_model(flash_attention=True)
        plain.fit(x, x, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model = _attention_model(flash_attention=True)
        choice = _FlashChoice()
        devices = len(kd.list_devices())
        model.fit(
            x,
            x,
            batch_size=16,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(_sequence((devices, 1))), choice],
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Keras runs flash_attention=True through cuDNN (it raises where cuDNN
    # cannot): the layer kept it at every step, and trained as plain Keras.
    assert choice.seen and set(choice.seen) == {True}
    assert _gap(plain, model) <= 1e-2


def test_flash_attention_under_a_real_split_gets_the_documented_error():
    devices = len(kd.list_devices())
    if devices < 2 or devices % 2:
        pytest.skip(
            f"{devices} device(s): no real split of the sequence "
            "(tests/test_sequence_attention_kernel.py proves it on 8 CPU devices)"
        )
    model = _attention_model(flash_attention=True)
    x = _tokens()
    with pytest.raises(ValueError, match="built with flash_attention=True"):
        model.fit(
            x,
            x,
            batch_size=16,
            verbose=0,
            callbacks=[kd.DistributeCallback(_sequence((devices // 2, 2)))],
        )


def test_checkpoint_save_and_restore(tmp_path):
    distribution = kd.DataParallel()
    model = _mlp()
    _fit(
        model,
        [kd.DistributeCallback(distribution), kd.Checkpoint(tmp_path, save_freq=2)],
    )
    restored = _mlp()
    restored.build((None, 32))
    step = kd.restore(restored, tmp_path)
    assert step == 8  # 128 rows in batches of 32, 2 epochs
    assert _gap(model, restored) == 0.0


def test_a_capped_gpu_runs_out_and_the_suggested_variant_fits(tmp_path):
    needs_cuda("a real device memory limit")
    output = tmp_path / "oom.json"
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KERAS_DIST", "XLA_PYTHON_CLIENT"))
    }
    environment.update(
        KERAS_BACKEND="jax",
        XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get(
            "KERAS_DIST_GPU_OOM_FRACTION", "0.03"
        ),
    )
    completed = subprocess.run(
        [sys.executable, str(HERE / "jax_oom_worker.py"), str(output)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, (
        completed.stdout[-3000:] + completed.stderr[-3000:]
    )
    result = json.loads(output.read_text())
    assert result["error"] == "OutOfDeviceMemoryError", result
    assert result["cause"] in ("XlaRuntimeError", "JaxRuntimeError", "RuntimeError")
    assert "short" in result["message"], result["message"]
    assert result["fitting_variants"], result["message"]
    assert result["variant_ran"] is True, result


@pytest.mark.parametrize(
    "model,offload", [("mlp", False), ("mlp", True), ("decoder", False)]
)
def test_the_planned_peak_is_within_10_percent_of_the_measured_one(
    tmp_path, model, offload
):
    needs_cuda("the device's measured peak (CPUs report none)")
    output = tmp_path / "peak.json"
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KERAS_DIST", "XLA_PYTHON_CLIENT"))
    }
    environment.update(KERAS_BACKEND="jax", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    arguments = [str(output), model, *(["offload"] if offload else [])]
    completed = subprocess.run(
        [sys.executable, str(HERE / "jax_peak_worker.py"), *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, (
        completed.stdout[-3000:] + completed.stderr[-3000:]
    )
    result = json.loads(output.read_text())
    if "plan_error" in result:
        if "local" in result["plan_error"]:
            pytest.skip(
                f"kd.plan(topology='local') is not here: {result['plan_error']}"
            )
        raise AssertionError(result["plan_error"])
    planned, measured = result["planned_peak_bytes"], result["measured_peak_bytes"]
    # No moment of fit holds more on the device than the step's plan (the
    # build, the slots' creation), within the plan's 10 %.
    assert abs(measured - planned) <= 0.1 * planned, result
