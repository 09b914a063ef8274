"""`scale_learning_rate` and `schedules.LinearWarmup`: the scaling rules, the
global batch taken from a distribution, the warmup's values, their config,
and training with the schedule under `kd.DataParallel`.

Pure logic runs on JAX only (8 simulated devices, KERAS_DIST_CPU_DEVICES=8);
the training check runs on every backend.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.schedules import LinearWarmup, scale_learning_rate


def _values(schedule, steps):
    return [float(schedule(step)) for step in steps]


@pytest.mark.backend("jax")
def test_linear_and_sqrt_rules():
    assert scale_learning_rate(
        0.1, base_batch_size=256, global_batch_size=1024
    ) == pytest.approx(0.1 * 1024 / 256)
    assert scale_learning_rate(
        0.1, "sqrt", base_batch_size=256, global_batch_size=1024
    ) == pytest.approx(0.1 * math.sqrt(4))
    # A smaller global batch lowers it.
    assert scale_learning_rate(
        0.3, "sqrt", base_batch_size=64, global_batch_size=16
    ) == pytest.approx(0.3 * math.sqrt(16 / 64))


@pytest.mark.backend("jax")
def test_the_global_batch_defaults_to_base_rows_per_replica():
    """The distribution's batch axis counts the replicas (keras_dist's and
    Keras' own policies); the active one is used when none is given."""
    devices = kd.list_devices()
    four = kd.DataParallel(devices=devices[:4])
    assert scale_learning_rate(
        0.1, base_batch_size=32, distribution=four
    ) == pytest.approx(0.4)
    mesh = kd.DeviceMesh((2, 4), ("batch", "model"), devices[:8])
    two = kd.ModelParallel(layout_map=kd.LayoutMap(mesh), batch_dim_name="batch")
    assert scale_learning_rate(
        0.1, "sqrt", base_batch_size=32, distribution=two
    ) == pytest.approx(0.1 * math.sqrt(2))
    keras_own = keras.distribution.DataParallel(devices=devices[:8])
    assert scale_learning_rate(
        0.1, base_batch_size=32, distribution=keras_own
    ) == pytest.approx(0.8)
    with four.scope():
        assert scale_learning_rate(0.1, base_batch_size=32) == pytest.approx(0.4)
        warmup = LinearWarmup(0.1, 2, base_batch_size=32)
    assert warmup.global_batch_size == 128  # resolved and kept
    assert float(warmup(2)) == pytest.approx(0.4)
    # An explicit global batch wins over the distribution.
    assert scale_learning_rate(
        0.1, base_batch_size=32, global_batch_size=64, distribution=four
    ) == pytest.approx(0.2)


@pytest.mark.backend("jax")
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"rule": "cubic"}, ValueError, r"one of \['linear', 'sqrt'\].*rule='cubic'"),
        ({"base_batch_size": 0}, ValueError, "base_batch_size=0"),
        ({"global_batch_size": -8}, ValueError, "global_batch_size=-8"),
        ({"base_batch_size": 32.0}, TypeError, "base_batch_size=32.0 of type float"),
        ({"global_batch_size": True}, TypeError, "global_batch_size=True"),
        ({"global_batch_size": None}, ValueError, "Pass `global_batch_size=`"),
        ({"distribution": "dp"}, TypeError, "distribution='dp'"),
    ],
)
def test_bad_input_is_named(arguments, error, message):
    options = {"rule": "linear", "base_batch_size": 32, "global_batch_size": 64}
    options.update(arguments)
    if "distribution" in arguments:
        options["global_batch_size"] = None
    rule = options.pop("rule")
    with pytest.raises(error, match=message):
        scale_learning_rate(0.1, rule, **options)
    with pytest.raises(error, match=message):
        LinearWarmup(0.1, 4, rule=rule, **options)


@pytest.mark.backend("jax")
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"warmup_steps": 2.5}, ValueError, "warmup_steps=2.5"),
        ({"learning_rate": "0.1"}, TypeError, "learning_rate='0.1'"),
        ({"initial_learning_rate": None}, TypeError, "initial_learning_rate=None"),
        ({"global_batch_size": 64}, ValueError, "base_batch_size=None"),
        ({"rule": "cubic"}, ValueError, "rule='cubic'"),
    ],
)
def test_bad_warmup_input_is_named(arguments, error, message):
    options = {"learning_rate": 0.1, "warmup_steps": 4, **arguments}
    with pytest.raises(error, match=message):
        LinearWarmup(
            options.pop("learning_rate"), options.pop("warmup_steps"), **options
        )


@pytest.mark.backend("jax")
def test_warmup_values_at_each_step():
    # To 0.1 * 1024 / 256 = 0.4 in 4 steps from 0, then constant.
    schedule = LinearWarmup(0.1, 4, base_batch_size=256, global_batch_size=1024)
    np.testing.assert_allclose(
        _values(schedule, range(7)), [0.0, 0.1, 0.2, 0.3, 0.4, 0.4, 0.4], atol=1e-7
    )
    # From the unscaled rate (Goyal et al.), with the sqrt rule: to 0.2.
    schedule = LinearWarmup(
        0.1,
        2,
        initial_learning_rate=0.1,
        rule="sqrt",
        base_batch_size=256,
        global_batch_size=1024,
    )
    np.testing.assert_allclose(_values(schedule, range(4)), [0.1, 0.15, 0.2, 0.2])
    # No warmup: the target from step 0.
    np.testing.assert_allclose(_values(LinearWarmup(0.3, 0), range(3)), [0.3] * 3)


@pytest.mark.backend("jax")
def test_warmup_into_a_schedule_that_starts_when_it_ends():
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    schedule = LinearWarmup(decay, 3, base_batch_size=16, global_batch_size=32)
    peak = 2 * float(decay(0))
    expected = [0.0, peak / 3, 2 * peak / 3] + [2 * float(decay(s)) for s in range(5)]
    np.testing.assert_allclose(_values(schedule, range(8)), expected, rtol=1e-6)


@pytest.mark.backend("jax")
def test_config_round_trip_keeps_the_values_and_the_resolved_batch():
    devices = kd.list_devices()
    decay = keras.optimizers.schedules.CosineDecay(0.05, 20)
    schedules = [
        LinearWarmup(
            0.1,
            5,
            initial_learning_rate=0.01,
            rule="sqrt",
            base_batch_size=8,
            distribution=kd.DataParallel(devices=devices[:8]),
        ),
        LinearWarmup(decay, 4),
    ]
    steps = (0, 2, 5, 9, 25)
    for schedule in schedules:
        again = LinearWarmup.from_config(schedule.get_config())
        assert again.get_config() == schedule.get_config()
        np.testing.assert_allclose(_values(again, steps), _values(schedule, steps))
        # Inside an optimizer's config (as `model.save` stores it).
        optimizer = keras.optimizers.SGD(learning_rate=schedule)
        loaded = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert loaded.get_config() == optimizer.get_config()
        for step in steps:
            loaded.iterations.assign(step)
            assert float(loaded.learning_rate) == pytest.approx(float(schedule(step)))
    assert schedules[0].get_config()["global_batch_size"] == 64


class _RecordRates(keras.callbacks.Callback):
    """The optimizer's learning rate before each step."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))


def _train(schedule, callbacks=()):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, name="out")], name="warmed"
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=schedule), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.normal(size=(48, 2)).astype("float32")
    model.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model


def test_trains_under_data_parallel_like_one_device():
    """6 steps, warming up over 4, with the global batch of `fit` (16)."""
    devices = kd.list_devices()
    distribution = kd.DataParallel(devices=devices[: min(4, len(devices))])

    def schedule():
        return LinearWarmup(0.05, 4, base_batch_size=8, global_batch_size=16)

    rates = _RecordRates()
    model = _train(schedule(), [kd.DistributeCallback(distribution), rates])
    reference = _train(schedule())
    # Warming up to 0.05 * 16 / 8 = 0.1 over steps 0..3.
    np.testing.assert_allclose(
        rates.rates, [0.0, 0.025, 0.05, 0.075, 0.1, 0.1], atol=1e-7
    )
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert int(np.asarray(model.optimizer.iterations)) == 6
    assert float(np.asarray(model.optimizer.learning_rate)) == pytest.approx(0.1)
    assert kd.distribution() is None
