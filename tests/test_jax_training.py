"""JAX end to end on 8 simulated CPU devices: parity, layouts, uneven data."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests import parity

pytestmark = pytest.mark.backend("jax")

SAMPLES = parity.SAMPLES
BATCH = 20  # does not divide the 8 devices either


def _fit_evaluate_predict(model, callbacks_factory, sample_weight=None, epochs=3):
    return parity.fit_evaluate_predict(
        model,
        callbacks_factory,
        batch=BATCH,
        epochs=epochs,
        sample_weight=sample_weight,
    )


class SubclassedTrainer(kd.Trainer, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.head = keras.layers.Dense(3, activation="softmax", name="head")

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def _subclassed_trainer(distribution) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = SubclassedTrainer(distribution=distribution)
    model(np.zeros((1, 6), "float32"))
    return parity.compile_model(model)


@pytest.fixture(scope="module")
def single_device_run():
    assert len(keras.distribution.list_devices()) == 8, (
        "run with KERAS_DIST_CPU_DEVICES=8"
    )
    model = parity.sequential()
    return model, _fit_evaluate_predict(model, lambda: [])


def test_callback_data_parallel_matches_single_device(single_device_run):
    reference_model, reference = single_device_run
    distribution = kd.DataParallel()
    model = parity.sequential()  # built and compiled before the distribution existed
    result = _fit_evaluate_predict(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)
    # The variables were laid out on all 8 devices, replicated.
    kernel = model.get_layer("hidden").kernel.value
    assert len(kernel.sharding.device_set) == 8
    assert kernel.sharding.is_fully_replicated
    # Switched off afterwards: Keras sees no distribution, steps are Keras' own.
    assert kd.distribution() is None
    assert "train_step" not in model.__dict__


def test_sample_weights_and_padding_match_single_device():
    x, y = parity.data()
    weights = np.linspace(0.1, 2.0, SAMPLES).astype("float32")
    reference_model = parity.sequential()
    reference = _fit_evaluate_predict(
        reference_model, lambda: [], sample_weight=weights
    )
    model = parity.sequential()
    distribution = kd.DataParallel()
    result = _fit_evaluate_predict(
        model, lambda: [kd.DistributeCallback(distribution)], sample_weight=weights
    )
    parity.assert_same_training(reference, result, reference_model, model)


@pytest.mark.parametrize("build", [parity.functional_trainer, _subclassed_trainer])
def test_trainer_mixin_matches_single_device(single_device_run, build):
    reference_model, reference = single_device_run
    model = build(kd.DataParallel())
    result = _fit_evaluate_predict(model, lambda: None)
    parity.assert_same_training(reference, result, reference_model, model)
    assert kd.distribution() is None


def test_trainer_uses_the_global_distribution(single_device_run):
    reference_model, reference = single_device_run
    model = parity.functional_trainer(None)
    distribution = kd.DataParallel()
    with distribution.scope():
        result = _fit_evaluate_predict(model, lambda: None)
        assert kd.distribution() is distribution
    parity.assert_same_training(reference, result, reference_model, model)
    assert len(model.get_layer("hidden").kernel.value.sharding.device_set) == 8


def test_trainer_without_distribution_trains_like_keras(single_device_run):
    reference_model, reference = single_device_run
    model = parity.functional_trainer(None)
    result = _fit_evaluate_predict(model, lambda: None)
    parity.assert_same_training(reference, result, reference_model, model)
    assert len(model.get_layer("hidden").kernel.value.sharding.device_set) == 1


def test_failed_fit_switches_the_distribution_off():
    model = parity.functional_trainer(kd.DataParallel())
    x, y = parity.data()

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[Boom()])
    assert kd.distribution() is None
    assert "train_step" not in model.__dict__
    model.fit(x, y, batch_size=BATCH, verbose=0)  # and it trains again


def test_reused_callback_after_a_failed_call():
    model = parity.sequential()
    x, y = parity.data()
    callback = kd.DistributeCallback(kd.DataParallel())

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback, Boom()])
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    assert kd.distribution() is None


def _model_parallel_distribution() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden/bias"] = ("model",)
    layout_map["hidden/output"] = ("batch", "model")
    return kd.ModelParallel(layout_map=layout_map)


def test_model_parallel_shards_kernels_and_optimizer_slots(single_device_run):
    reference_model, reference = single_device_run
    distribution = _model_parallel_distribution()
    model = parity.sequential()
    result = _fit_evaluate_predict(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)

    kernel = model.get_layer("hidden").kernel
    shards = kernel.value.addressable_shards
    assert len(shards) == 8
    assert {shard.data.shape for shard in shards} == {(6, 4)}  # 16 columns / 4
    assert tuple(kernel.value.sharding.spec) == (None, "model")
    # Optimizer slots (Adam's moments) follow their variable's layout.
    slots = [v for v in model.optimizer.variables if v.shape == (6, 16)]
    assert len(slots) == 2
    for slot in slots:
        assert {s.data.shape for s in slot.value.addressable_shards} == {(6, 4)}
    # Unmapped variables stay replicated.
    assert model.get_layer("head").kernel.value.sharding.is_fully_replicated


def test_model_parallel_relayouts_a_layer_output():
    distribution = _model_parallel_distribution()
    with distribution.scope():
        model = keras.Sequential(parity.layers())
        hidden = keras.Model(model.inputs, model.get_layer("hidden").output)
        outputs = hidden(np.ones((8, 6), "float32"))
    assert tuple(outputs.sharding.spec) == ("batch", "model")
    assert {s.data.shape for s in outputs.addressable_shards} == {(4, 4)}
    # Variables created under the scope got their layout at creation.
    assert tuple(model.get_layer("hidden").kernel.value.sharding.spec) == (
        None,
        "model",
    )


def test_trainer_with_model_parallel(single_device_run):
    reference_model, reference = single_device_run
    model = _subclassed_trainer(_model_parallel_distribution())
    result = _fit_evaluate_predict(model, lambda: None)
    parity.assert_same_training(reference, result, reference_model, model)
    assert tuple(model.hidden.kernel.value.sharding.spec) == (None, "model")


def test_keras_alone_fails_on_a_model_built_before_the_distribution():
    """The gap keras_dist closes: Keras' own DataParallel needs the model built
    under it. If a Keras release fixes this, this test tells us."""
    model = parity.sequential()
    x, y = parity.data()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    with (
        pytest.raises(ValueError, match="incompatible devices"),
        pytest.warns(UserWarning),
    ):
        model.fit(x, y, batch_size=16, verbose=0)


def test_fit_in_a_loop_reuses_the_compiled_step_until_compile_changes_it():
    model = parity.sequential()
    x, y = parity.data()
    distribution = kd.DataParallel()
    seen = []

    class RecordStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.train_function)

    def fit():
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution), RecordStep()],
        )
        return seen[-1]

    first = fit()
    assert fit() is first
    assert model.train_function is None  # plain Keras steps outside the run
    parity.compile_model(model)
    assert fit() is not first
    other = kd.DataParallel(devices=kd.list_devices()[:4])
    assert model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(other)],
    )
    assert len(model.get_layer("hidden").kernel.value.sharding.device_set) == 4


def test_batch_norm_normalizes_over_the_global_batch_without_padding():
    """Statistics over all real rows of each global batch, as on one device;
    the last batch is padded to the devices and the padding left out."""
    reference_model = parity.batch_norm_sequential()
    reference = _fit_evaluate_predict(reference_model, lambda: [], epochs=2)
    model = parity.batch_norm_sequential()
    result = _fit_evaluate_predict(
        model, lambda: [kd.DistributeCallback(kd.DataParallel())], epochs=2
    )
    parity.assert_same_training(reference, result, reference_model, model)


def _token_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(16, 8)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(16)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_a_loss_per_token_on_padded_batches_matches_single_device():
    """Batches of 20 rows on 8 devices are padded: the padding mask weighs a
    loss of shape [batch, sequence] (token labels) as it does one per row."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (40, 6)).astype("int32")
    y = rng.integers(0, 16, (40, 6)).astype("int32")
    reference = _token_model()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    model = _token_model()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(
            history.history[name], expected.history[name], rtol=1e-5
        )
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    evaluated = model.evaluate(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    wanted = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(evaluated["loss"], wanted["loss"], rtol=1e-5)
