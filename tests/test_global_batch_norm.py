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


def _keras_normalization(calls):
    """A stand-in for a backend's one-op global normalization (torch:
    `global_batch_norm`): Keras' own formula, recording what it was given."""
    ops = keras.ops

    def normalize(inputs, scale, offset, epsilon):
        calls.append((scale is None, offset is None))
        axes = tuple(range(len(inputs.shape) - 1))
        mean, variance = ops.moments(inputs, axes)
        outputs = ops.batch_normalization(
            inputs, mean, variance, -1, offset=offset, scale=scale, epsilon=epsilon
        )
        return outputs, mean, variance

    return normalize


@pytest.mark.parametrize("scale", [True, False])
def test_a_backend_normalization_runs_in_place_of_keras_call_with_its_updates(scale):
    """Where a backend normalizes in one op, the layer's outputs and moving
    statistics are those of Keras' own `call`; a padded batch, one replica or
    a call outside a keras_dist step run Keras' `call`."""
    rng = np.random.default_rng(4)
    x = keras.ops.convert_to_tensor(
        (5.0 + rng.normal(size=(6, 2, 3))).astype("float32")
    )

    def layer_and_twin():
        layers = [
            keras.layers.BatchNormalization(momentum=0.8, scale=scale, name=f"bn{i}")
            for i in range(2)
        ]
        for layer in layers:
            layer.build(x.shape)
            if scale:
                layer.gamma.assign(np.array([0.5, 2.0, 1.5], "float32"))
            layer.beta.assign(np.array([0.1, -0.2, 0.3], "float32"))
        return layers

    def run(replicas, rows, padded):
        layer, twin = layer_and_twin()
        undo = replace_moments(
            layer,
            functools.partial(GlobalBatchNorm.moments, replicas),
            functools.partial(GlobalBatchNorm.normalize, replicas),
        )
        try:
            if rows is None:
                ours = layer(x, training=True)
            else:
                with GlobalBatchNorm.rows(rows, padded):
                    ours = layer(x, training=True)
        finally:
            undo()
        assert "call" not in layer.__dict__
        keras_own = twin(x, training=True)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours),
            keras.ops.convert_to_numpy(keras_own),
            # The stand-in's `ops.moments` and the layer's `_moments` may round
            # differently (inputs far from zero).
            rtol=1e-5,
            atol=1e-5,
        )
        for ours_var, own_var in zip(
            layer.non_trainable_variables, twin.non_trainable_variables, strict=True
        ):
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(ours_var),
                keras.ops.convert_to_numpy(own_var),
                atol=1e-6,
            )

    calls = []
    two = GlobalBatchNorm.Replicas(count=2, normalize=_keras_normalization(calls))
    ones = keras.ops.ones((6,))
    run(two, ones, padded=False)
    assert calls == [(not scale, False)]
    # Keras' own call (with keras_dist's moments) where the op does not apply.
    run(two, ones, padded=True)
    run(two, None, padded=False)
    one = GlobalBatchNorm.Replicas(normalize=_keras_normalization(calls))
    run(one, ones, padded=False)
    assert len(calls) == 1
