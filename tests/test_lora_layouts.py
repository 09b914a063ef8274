"""LoRA factors (`enable_lora`) laid out with their base kernels.

With no LayoutMap key of their own, `lora_kernel_a` takes its kernel's axes
on the dimensions they share and `lora_kernel_b` the kernel's output axis, so
`a @ b` is laid out as the kernel it is added to; FSDP adds its axis on top.
JAX trains the model under that layout as plain Keras on one device does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(16, name="down"),
            keras.layers.Dense(4, name="out"),
        ]
    )
    rng = np.random.default_rng(0)
    for layer in model.layers[:2]:
        layer.enable_lora(4)
        # Keras starts `b` at zero; nonzero, the factors change the output.
        b = layer.lora_kernel_b
        b.assign(0.1 * rng.normal(size=b.shape).astype("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _layout_map(mesh):
    layout_map = kd.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def _axes(distribution, model) -> dict[str, tuple]:
    return {
        variable.path.split("/", 1)[1]: tuple(
            distribution.layout_for_variable(variable).axes
        )
        for variable in model.weights
    }


@pytest.mark.backend_neutral
def test_lora_factors_follow_their_kernels_layout():
    devices = kd.list_devices()
    mesh = kd.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    axes = _axes(kd.ModelParallel(layout_map=_layout_map(mesh)), _model())
    assert axes["up/lora_kernel_a"] == (None, None)
    assert axes["up/lora_kernel_b"] == (None, "model")
    assert axes["down/lora_kernel_a"] == ("model", None)
    assert axes["down/lora_kernel_b"] == (None, None)
    # A key of their own wins.
    layout_map = _layout_map(mesh)
    layout_map["up/lora_kernel_b"] = (None, None)
    axes = _axes(kd.ModelParallel(layout_map=layout_map), _model())
    assert axes["up/lora_kernel_b"] == (None, None)


@pytest.mark.backend("jax")
def test_lora_under_fsdp_and_tensor_parallelism_trains_as_one_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    reference = _model()
    reference.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"], kd.list_devices()[:8])
    distribution = kd.FSDP(layout_map=_layout_map(mesh), min_size=16)
    model = _model()
    axes = _axes(distribution, model)
    assert axes["up/lora_kernel_b"] == ("batch", "model")
    assert axes["down/lora_kernel_a"] == ("model", "batch")
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
