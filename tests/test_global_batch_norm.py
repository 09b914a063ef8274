"""BatchNormalization statistics over the real rows of a batch, on every backend
(one replica; the multi-replica sums are tested by the parity tests)."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest

from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.keras_compat.batch_norm import replace_moments


def _moments(layer, x, rows, mask=None):
    model = keras.Sequential([layer])
    model.build(x.shape)
    undo = replace_moments(
        model, functools.partial(GlobalBatchNorm.moments, GlobalBatchNorm.Replicas())
    )
    try:
        with GlobalBatchNorm.rows(keras.ops.convert_to_tensor(rows)):
            mean, variance = layer._moments(keras.ops.convert_to_tensor(x), mask)
    finally:
        undo()
    return keras.ops.convert_to_numpy(mean), keras.ops.convert_to_numpy(variance)


def test_padding_rows_are_left_out_and_far_from_zero_stays_exact():
    rng = np.random.default_rng(0)
    # Far from zero: E[x^2] - E[x]^2 in float32 would lose every digit here.
    x = (3000.0 + rng.normal(size=(8, 3))).astype("float32")
    rows = np.array([1, 1, 1, 1, 1, 1, 0, 0], "float32")
    x[6:] = 0.0  # padding rows are zeros
    mean, variance = _moments(keras.layers.BatchNormalization(), x, rows)
    real = x[:6].astype("float64")
    np.testing.assert_allclose(mean, real.mean(0), rtol=1e-6)
    np.testing.assert_allclose(variance, real.var(0), rtol=1e-3)


def test_channels_first_and_a_keras_mask():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 2, 3, 3)).astype("float32")
    rows = np.array([1, 1, 1, 0], "float32")
    mean, variance = _moments(keras.layers.BatchNormalization(axis=1), x, rows)
    real = x[:3].astype("float64")
    np.testing.assert_allclose(mean, real.mean((0, 2, 3)), atol=1e-6)
    np.testing.assert_allclose(variance, real.var((0, 2, 3)), atol=1e-5)

    sequence = rng.normal(size=(3, 5, 2)).astype("float32")
    steps = np.ones((3, 5), bool)
    steps[1, 3:] = False  # a sequence two steps shorter
    mean, variance = _moments(
        keras.layers.BatchNormalization(),
        sequence,
        np.array([1, 1, 0], "float32"),
        keras.ops.convert_to_tensor(steps),
    )
    real = np.concatenate([sequence[0], sequence[1, :3]]).astype("float64")
    np.testing.assert_allclose(mean, real.mean(0), atol=1e-6)
    np.testing.assert_allclose(variance, real.var(0), atol=1e-5)


def test_outside_a_keras_dist_step_keras_own_moments_run():
    layer = keras.layers.BatchNormalization()
    model = keras.Sequential([layer])
    x = np.random.default_rng(2).normal(size=(5, 3)).astype("float32")
    model.build(x.shape)
    undo = replace_moments(
        model, functools.partial(GlobalBatchNorm.moments, GlobalBatchNorm.Replicas())
    )
    try:
        ours = layer._moments(keras.ops.convert_to_tensor(x), None)
    finally:
        undo()
    keras_own = type(layer)._moments(layer, keras.ops.convert_to_tensor(x), None)
    for a, b in zip(ours, keras_own, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        )
    assert "_moments" not in layer.__dict__


def test_a_first_axis_other_than_the_rows_with_padding_is_refused_eagerly():
    if keras.backend.backend() != "torch":
        pytest.skip("eager check: torch; traced backends warn instead")
    x = np.ones((8, 3), "float32")  # e.g. two views of 4 rows stacked
    with pytest.raises(NotImplementedError, match=r"'bn'.*\(8, 3\).*4 rows"):
        _moments(
            keras.layers.BatchNormalization(name="bn"),
            x,
            np.array([1, 1, 1, 0], "float32"),
        )


def test_a_batch_known_to_have_no_padding_uses_keras_own_moments():
    layer = keras.layers.BatchNormalization()
    model = keras.Sequential([layer])
    x = np.random.default_rng(3).normal(size=(4, 3)).astype("float32")
    model.build(x.shape)
    tensor = keras.ops.convert_to_tensor(x)
    undo = replace_moments(
        model, functools.partial(GlobalBatchNorm.moments, GlobalBatchNorm.Replicas())
    )
    try:
        with GlobalBatchNorm.rows(keras.ops.ones((4,)), padded=False):
            ours = layer._moments(tensor, None)
    finally:
        undo()
    keras_own = type(layer)._moments(layer, tensor, None)
    for a, b in zip(ours, keras_own, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        )
