"""A sharded mixed-precision policy: `kd.MixedPrecisionPolicy` given to
`kd.FSDP` and `kd.ModelParallel` (`mixed_precision=`).

A float32 model trained under the policy is the same training as that model
built under Keras' `mixed_bfloat16` policy and trained under the same
distribution without one (bitwise), and within bfloat16's rounding of plain
Keras' `mixed_bfloat16` fit on one device (while float32 training is ten
times further away). JAX: 8 simulated devices in this process. PyTorch: a
2-process gloo job (tests/workers/mixed_precision_worker.py), where FSDP also
gathers the weights in bfloat16 and can sum gradients in float32.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job

SAMPLES, BATCH, EPOCHS = 48, 16, 2
# bfloat16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 2e-3 of each
# product and gradient); summed over devices in another order than on one
# device, SGD(0.1) weights after 6 steps differ by about 1e-4 (measured: 9.8e-5
# on JAX, 8.5e-5 to 1.1e-4 on PyTorch). Float32 training is 2e-3 to 5e-3 away.
BF16_ATOL = 5e-4
FLOAT32_IS_FURTHER = 1e-3


def _build(policy: str) -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(64, activation="relu", name="first"),
                keras.layers.Dense(64, activation="relu", name="second"),
                keras.layers.Dense(4, name="logits"),
            ]
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = rng.integers(0, 4, size=(SAMPLES,))
    return x, y


def _fit(model, distribution=None):
    callbacks = [kd.DistributeCallback(distribution)] if distribution else []
    model.fit(
        *_data(),
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return [np.asarray(w) for w in model.get_weights()]


def _distance(ours, theirs) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(ours, theirs, strict=True)
    )


def _model_parallel(**kwargs):
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"], kd.list_devices()[:8])
    layout_map = kd.LayoutMap(mesh)
    layout_map["first/kernel"] = (None, "model")
    layout_map["second/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, **kwargs)


@pytest.mark.backend("jax")
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_jax_policy_trains_as_keras_mixed_bfloat16(kind):
    def distribution(**kwargs):
        if kind == "fsdp":
            return kd.FSDP(min_size=64, **kwargs)
        return _model_parallel(**kwargs)

    one_device = _fit(_build("mixed_bfloat16"))
    built_mixed = _fit(_build("mixed_bfloat16"), distribution())
    model = _build("float32")
    policy = _fit(model, distribution(mixed_precision="bfloat16"))
    float32 = _fit(_build("float32"), distribution())
    assert _distance(policy, built_mixed) == 0.0
    assert _distance(float32, one_device) > FLOAT32_IS_FURTHER
    if kind == "fsdp":
        assert _distance(policy, one_device) < BF16_ATOL
    else:
        # A kernel split along its input dimension makes bfloat16 partial
        # products on each device, summed over the model axis: rounded other
        # than one device's (2.5e-3 away after 6 steps, float32 5.2e-3).
        assert _distance(policy, float32) > FLOAT32_IS_FURTHER
    # The model is float32 again after the call, its variables float32 throughout.
    assert [layer.dtype_policy.name for layer in model.layers] == ["float32"] * 3
    assert {w.dtype for w in model.weights} == {"float32"}


@pytest.mark.backend("torch")
def test_torch_fsdp_gathers_in_bfloat16_and_reduces_in_the_policys_dtype(tmp_path):
    results = run_job(
        "mixed_precision_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
        timeout=300,
    )
    for result in results:
        one_device = result["one_device_mixed"]["weights"]
        policy = result["fsdp_policy"]["weights"]
        assert _distance(policy, result["fsdp_mixed_built"]["weights"]) == 0.0
        assert _distance(policy, one_device) < BF16_ATOL
        # Summed in float32: another training, as close to one device.
        f32_reduce = result["fsdp_policy_f32_reduce"]["weights"]
        assert _distance(f32_reduce, policy) > 0.0
        assert _distance(f32_reduce, one_device) < BF16_ATOL
        assert _distance(result["float32"]["weights"], one_device) > FLOAT32_IS_FURTHER
        # FSDP gathered the split kernel cast to bfloat16 (under the policy and
        # for a model built mixed alike); float32 training reads float32.
        for name in ("fsdp_mixed_built", "fsdp_policy", "fsdp_policy_f32_reduce"):
            assert "bfloat16" in result[name]["kernel_read_as"], name
        assert result["float32"]["kernel_read_as"] == ["float32"]
        assert result["fsdp_policy"]["policies"] == ["float32"] * 3
        # Through DTensor a reduce dtype of its own is refused at the start,
        # the model untouched and trainable.
        assert "Leave `reduce_dtype` None there" in result["refused"]
        assert result["refused_unchanged"]
        assert len(result["refused_then_plain"]) == EPOCHS
    assert results[0]["fsdp_policy"]["loss"] == results[1]["fsdp_policy"]["loss"]


@pytest.mark.backend_neutral
def test_policy_arguments_are_checked_at_construction():
    policy = kd.MixedPrecisionPolicy()
    assert (policy.compute_dtype, policy.reduce_dtype) == ("bfloat16", None)
    assert kd.MixedPrecisionPolicy("bfloat16", "bfloat16").reduce_dtype is None
    with pytest.raises(ValueError, match="needs loss scaling"):
        kd.MixedPrecisionPolicy("float16")
    with pytest.raises(ValueError, match=r"Received: compute_dtype='int8'"):
        kd.MixedPrecisionPolicy("int8")
    with pytest.raises(ValueError, match=r"Received: reduce_dtype='float64'"):
        kd.MixedPrecisionPolicy(reduce_dtype="float64")
    with pytest.raises(TypeError, match="Received: mixed_precision=16"):
        kd.FSDP(mixed_precision=16)
    distribution = kd.FSDP(mixed_precision="bfloat16")
    assert distribution.mixed_precision == kd.MixedPrecisionPolicy("bfloat16")
    assert "mixed_precision=" in repr(distribution)
    assert kd.DataParallel().mixed_precision is None


@pytest.mark.backend("jax", "tensorflow")
def test_a_reduce_dtype_of_its_own_is_refused_where_xla_places_the_sum():
    with pytest.raises(NotImplementedError, match="XLA sums a sharded gradient"):
        kd.MixedPrecisionPolicy("bfloat16", reduce_dtype="float32")
