"""TensorFlow end to end in one process: MirroredStrategy over 4 logical CPUs."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests import parity

pytestmark = pytest.mark.backend("tensorflow")

SAMPLES = parity.SAMPLES
BATCH = 18  # does not divide the 4 devices either
DEVICES = 4


def _fit_evaluate_predict(model, callbacks_factory, sample_weight=None, epochs=2):
    return parity.fit_evaluate_predict(
        model,
        callbacks_factory,
        batch=BATCH,
        epochs=epochs,
        sample_weight=sample_weight,
    )


def _distribution() -> kd.DataParallel:
    return kd.DataParallel(devices=kd.list_devices()[:DEVICES])


def _replicas(variable) -> int:
    """On how many devices a variable is mirrored (1 for a plain variable)."""
    return len(getattr(variable.value, "values", [variable.value]))


@pytest.fixture(scope="module")
def single_device_run():
    assert len(kd.list_devices()) >= DEVICES, "run with KERAS_DIST_CPU_DEVICES=8"
    model = parity.sequential()
    return model, _fit_evaluate_predict(model, lambda: [])


def test_callback_matches_single_device_for_a_model_built_outside_the_scope(
    single_device_run,
):
    reference_model, reference = single_device_run
    distribution = _distribution()
    model = parity.sequential()  # built and compiled before the distribution existed
    assert _replicas(model.get_layer("hidden").kernel) == 1
    result = _fit_evaluate_predict(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)
    # Every step ran once, not once per replica; after the calls the model's
    # variables are plain ones again (`test_after_each_call_...`).
    assert all(_replicas(v) == 1 for v in model.optimizer.variables)
    steps = reference_model.optimizer.iterations.numpy()
    assert model.optimizer.iterations.numpy() == steps
    assert kd.distribution() is None
    assert "train_step" not in model.__dict__


@pytest.fixture
def unpatched_keras(monkeypatch):
    """Keras' own `_maybe_symbolic_build`, as in a process where no keras_dist
    call has run yet (the first activation installs the workaround)."""
    from keras_dist.backends.tensorflow import keras_internals as tf_keras_internals

    monkeypatch.setattr(
        tf_keras_internals.TensorFlowTrainer,
        "_maybe_symbolic_build",
        tf_keras_internals.KERAS_MAYBE_SYMBOLIC_BUILD,
    )


def test_model_built_under_the_scope_is_mirrored_from_the_start(
    single_device_run, unpatched_keras
):
    reference_model, reference = single_device_run
    distribution = _distribution()
    with distribution.scope():
        model = parity.sequential()
        assert kd.distribution() is distribution
    assert _replicas(model.get_layer("hidden").kernel) == DEVICES
    result = _fit_evaluate_predict(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)


def test_sample_weights_and_padding_match_single_device():
    weights = np.linspace(0.1, 2.0, SAMPLES).astype("float32")
    reference_model = parity.sequential()
    reference = _fit_evaluate_predict(
        reference_model, lambda: [], sample_weight=weights, epochs=1
    )
    model = parity.sequential()
    distribution = _distribution()
    result = _fit_evaluate_predict(
        model,
        lambda: [kd.DistributeCallback(distribution)],
        sample_weight=weights,
        epochs=1,
    )
    parity.assert_same_training(reference, result, reference_model, model)


def test_trainer_mixin_matches_single_device(single_device_run):
    reference_model, reference = single_device_run
    model = parity.functional_trainer(_distribution())
    result = _fit_evaluate_predict(model, lambda: None)
    parity.assert_same_training(reference, result, reference_model, model)
    assert kd.distribution() is None
    # Built outside the scope: mirrored during each call, plain after it.
    assert _replicas(model.get_layer("hidden").kernel) == 1


def test_trainer_uses_the_global_distribution(single_device_run, unpatched_keras):
    """Built in `dist.scope()`, the model carries the strategy: Keras builds it
    from its own split of the first batch (18 rows: 5, 5, 4, 4) before
    keras_dist's callback runs, which fails unless the scope fixed it."""
    reference_model, reference = single_device_run
    distribution = _distribution()
    with distribution.scope():
        model = parity.functional_trainer(None)
        result = _fit_evaluate_predict(model, lambda: None)
    parity.assert_same_training(reference, result, reference_model, model)
    assert _replicas(model.get_layer("hidden").kernel) == DEVICES


def _regression_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(
        optimizer="sgd",
        loss="mse",
        metrics=["mae", keras.metrics.AUC(name="auc")],
        weighted_metrics=["mse"],
    )
    return model


def _regression_data():
    x, _ = parity.data(3)
    y = (x[:, :1] > 0).astype("float32")
    return x, y


def test_metrics_are_global_at_every_step():
    # Per-batch logs, not only epoch logs: each step sums every replica's
    # metric states (AUC's confusion counts included) before computing results.
    x, y = _regression_data()
    weights = np.linspace(0.5, 1.5, SAMPLES).astype("float32")

    def batch_logs(callbacks):
        records = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                records.append(dict(logs))

        model = _regression_model()
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[*callbacks, Record()],
        )
        return records, model.evaluate(x, y, verbose=0, return_dict=True)

    expected, expected_eval = batch_logs([])
    logs, evaluation = batch_logs([kd.DistributeCallback(_distribution())])
    assert len(logs) == len(expected) == 6
    for got, want in zip(logs, expected, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0)
    for key in expected_eval:
        np.testing.assert_allclose(evaluation[key], expected_eval[key], atol=1e-5)


class _Sequence(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def _generator(x, y):
    for start in range(0, len(x), BATCH):
        yield x[start : start + BATCH], y[start : start + BATCH]


@pytest.mark.parametrize("kind", ["tf.data", "PyDataset", "generator"])
def test_every_input_type_matches_single_device(kind):
    import tensorflow as tf

    x, y = parity.data()

    def inputs():
        if kind == "tf.data":
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        if kind == "PyDataset":
            return _Sequence(x, y)
        return _generator(x, y)

    reference = parity.sequential()
    reference.fit(inputs(), epochs=1, verbose=0)
    model = parity.sequential()
    model.fit(
        inputs(),
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution())],
    )
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    predictions = model.predict(
        x,
        batch_size=BATCH,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution())],
    )
    np.testing.assert_allclose(
        predictions, reference.predict(x, batch_size=BATCH, verbose=0), atol=1e-5
    )


def test_failed_fit_switches_the_distribution_off():
    model = parity.functional_trainer(_distribution())
    x, y = parity.data()

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[Boom()])
    assert kd.distribution() is None
    assert "train_step" not in model.__dict__
    model.fit(x, y, batch_size=BATCH, verbose=0)  # and it trains again


def test_devices_tensorflow_does_not_have_are_refused():
    mesh = kd.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:99"])
    with pytest.raises(ValueError, match=r"\['cpu:99'\]"):
        parity.sequential().fit(
            *parity.data(),
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel(mesh))],
        )
    assert kd.distribution() is None


def test_replicas_along_a_model_axis_are_refused():
    # Every TensorFlow replica reads its own rows: a model axis that only
    # replicates has no tf.distribute equivalent.
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices()[:4])
    distribution = kd.ModelParallel(layout_map=kd.LayoutMap(mesh))
    with pytest.raises(ValueError, match="batch axis has 2 of the 4 devices"):
        parity.sequential().fit(
            *parity.data(),
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution)],
        )
    assert kd.distribution() is None


def test_keras_alone_ignores_a_data_parallel_distribution():
    """The gap keras_dist closes: on TensorFlow, Keras' own DataParallel trains
    on one device without a word. If a Keras release fixes this, this test
    tells us."""
    model = parity.sequential()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model.fit(*parity.data(), batch_size=BATCH, verbose=0)
    assert _replicas(model.get_layer("hidden").kernel) == 1
    assert model.distribute_strategy.num_replicas_in_sync == 1


def test_batch_norm_normalizes_over_the_global_batch_without_padding():
    """Statistics over all real rows of each global batch, as on one device;
    the last batch is padded to the devices and the padding left out."""
    reference_model = parity.batch_norm_sequential()
    reference = _fit_evaluate_predict(reference_model, lambda: [], epochs=2)
    model = parity.batch_norm_sequential()
    result = _fit_evaluate_predict(
        model, lambda: [kd.DistributeCallback(_distribution())], epochs=2
    )
    parity.assert_same_training(reference, result, reference_model, model)


def test_fit_in_a_loop_reuses_the_traced_step_and_trains_like_one_device():
    """The second call reuses the first one's traced functions (no retracing)
    until `compile()` changes what they depend on; the fits still equal
    single-device fits, also after a `compile()` outside any scope."""
    x, y = parity.data()
    reference = parity.sequential()
    for _ in range(2):
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = parity.sequential()
    distribution = _distribution()
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
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution), RecordStep()],
        )
        return seen[-1]

    first = fit()
    assert fit() is first
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert model.train_function is None  # Keras' own steps outside the run
    # A compile() outside any scope after the model was mirrored: a new
    # optimizer, traced anew, still training like one device.
    parity.compile_model(model)
    assert fit() is not first
    parity.compile_model(reference)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def _fit_one_epoch(model, callbacks=()):
    x, y = parity.data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def test_after_each_call_the_model_is_an_ordinary_keras_model_again():
    """Keras' own BackupAndRestore tests read `int(layer.counter.value)` after
    a distributed `fit`: a `MirroredVariable` has no `__int__`. During a call
    the variables are mirrored on the devices; after it, plain TF variables
    holding the trained values, so that what the user does between calls
    (assign, plain Keras `fit`) acts on the model the next call trains."""
    import tensorflow as tf  # noqa: PLC0415

    reference = parity.sequential()
    model = parity.sequential()
    distribution = _distribution()
    during = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            kernel = self.model.get_layer("hidden").kernel
            during.append(
                (_replicas(kernel), _replicas(self.model.optimizer.iterations))
            )

    _fit_one_epoch(reference)
    _fit_one_epoch(model, [kd.DistributeCallback(distribution), Record()])
    assert set(during) == {(DEVICES, DEVICES)}
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    assert all(_replicas(v) == 1 for v in variables)
    assert not any(
        isinstance(v.value, tf.distribute.DistributedValues) for v in variables
    )
    assert int(model.optimizer.iterations.value) == int(
        reference.optimizer.iterations.value
    )
    assert model.distribute_strategy is tf.distribute.get_strategy()
    # Set between calls, trained from by the next call; then plain Keras.
    for each in (reference, model):
        each.get_layer("head").bias.assign(np.full((3,), 0.5, "float32"))
    _fit_one_epoch(reference)
    _fit_one_epoch(model, [kd.DistributeCallback(distribution), Record()])
    _fit_one_epoch(reference)
    _fit_one_epoch(model)
    assert all(_replicas(v) == 1 for v in model.variables)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    for ours, theirs in zip(
        model.optimizer.variables, reference.optimizer.variables, strict=True
    ):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-5, rtol=0)


def test_ema_weights_swapped_by_keras_callback_match_single_device():
    """`use_ema=True` and `keras.callbacks.SwapEMAWeights` (which swaps through
    the optimizer's strategy): as in plain Keras on one device."""

    def build():
        # As Keras' own SwapEMAWeights tests, a model built by `fit` (their
        # jit_compile=True is refused on CPU devices: the next test).
        keras.utils.set_random_seed(1)
        model = keras.Sequential(parity.layers()[1:])
        model.compile(
            optimizer=keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    x, y = parity.data()
    results = []
    distribution = _distribution()
    for distributed in (False, True):
        callbacks = [kd.DistributeCallback(distribution)] if distributed else []
        model = build()
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, y),
            callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True), *callbacks],
        )
        evaluated = model.evaluate(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[
                keras.callbacks.SwapEMAWeights(),
                *([kd.DistributeCallback(distribution)] if distributed else []),
            ],
        )
        results.append((model.get_weights(), history.history, evaluated))
    (reference, reference_logs, reference_eval), (ours, logs, evaluated) = results
    for mine, theirs in zip(ours, reference, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)
    for key, values in reference_logs.items():
        np.testing.assert_allclose(logs[key], values, atol=1e-5, rtol=0, err_msg=key)
    np.testing.assert_allclose(evaluated, reference_eval, atol=1e-5, rtol=0)


def test_xla_on_several_cpu_devices_is_refused_before_a_step():
    """XLA cannot run a replica step over logical CPU devices (plain Keras with
    its own MirroredStrategy fails the same, deep inside the first step)."""
    model = parity.sequential()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    before = [w.copy() for w in model.get_weights()]
    x, y = parity.data()
    with pytest.raises(ValueError, match=r"jit_compile=True cannot run on several CPU"):
        model.fit(
            x,
            keras.ops.one_hot(y, 3),
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(_distribution())],
        )
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)
    assert kd.distribution() is None


def test_scalar_variables_read_as_numbers_during_a_call():
    """Keras' own callback test reads `int(model.iterations)` in a callback:
    a mirrored variable had no `__int__`."""
    model = parity.sequential()
    seen = []

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            iterations = self.model.optimizer.iterations
            assert _replicas(iterations) == DEVICES
            seen.append((int(iterations), float(iterations)))

    _fit_one_epoch(model, [kd.DistributeCallback(_distribution()), Read()])
    steps = -(-parity.SAMPLES // BATCH)
    assert seen == [(step, float(step)) for step in range(1, steps + 1)]


def test_predict_of_a_tuple_or_dict_input_matches_plain_keras():
    """A tuple `x` is one input of two parts (Keras packs it `((x1, x2),)`),
    not an input and a target."""

    class TupleInput(keras.Model):
        def call(self, inputs):
            first, second = inputs
            return first + second

    class DictInput(keras.Model):
        def call(self, inputs):
            return inputs["a"] * inputs["b"]

    rng = np.random.default_rng(3)
    first, second = rng.random((2, 21, 4)).astype("float32")
    for model, x in (
        (TupleInput(), (first, second)),
        (DictInput(), {"a": first, "b": second}),
    ):
        expected = model.predict(x, batch_size=BATCH, verbose=0)
        ours = model.predict(
            x,
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(_distribution())],
        )
        np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


def test_a_model_built_in_another_strategys_scope_is_refused_naming_it():
    import tensorflow as tf  # noqa: PLC0415

    users_own = tf.distribute.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with users_own.scope():
        model = parity.sequential()
    x, y = parity.data()
    with pytest.raises(ValueError, match=r"built in the scope of another.*Mirrored"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(_distribution())],
        )
    assert kd.distribution() is None


def test_strategies_over_different_devices_and_the_users_own_share_a_process():
    """Every MirroredStrategy numbers its collective groups from the same key,
    so a second one over other devices (or the user's own) joined the first's
    groups: "joining a group with size 4, but that group has size 8"."""
    import tensorflow as tf  # noqa: PLC0415

    x = np.ones((20, 3), "float32")

    def train(devices=None, strategy=None):
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        callbacks = []
        if devices is not None:
            callbacks = [kd.DistributeCallback(kd.DataParallel(devices=devices))]
        model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=callbacks)
        return model.get_weights()[0]

    expected = train()
    np.testing.assert_allclose(train(kd.list_devices()), expected, atol=1e-6)
    np.testing.assert_allclose(train(kd.list_devices()[:2]), expected, atol=1e-6)
    users_own = tf.distribute.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    np.testing.assert_allclose(train(strategy=users_own), expected, atol=1e-6)
    np.testing.assert_allclose(train(kd.list_devices()[:4]), expected, atol=1e-6)


def test_each_epochs_iterator_is_destroyed_off_the_training_thread(monkeypatch):
    """Destroying a distributed iterator can wait seconds to a minute for
    `tf.data`'s autotuning threads (TensorFlow 2.21); keras_dist drops each
    epoch's iterator on its reaper thread, so that wait never falls between
    two epochs on the thread that trains."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    from keras_dist.backends.tensorflow.iterator_reaper import REAPER  # noqa: PLC0415

    destroyed_on: list[str] = []
    made = []
    adopt = REAPER.adopt

    def watched_adopt(iterator):
        made.append(1)
        weakref.finalize(
            iterator, lambda: destroyed_on.append(threading.current_thread().name)
        )
        return adopt(iterator)

    monkeypatch.setattr(REAPER, "adopt", watched_adopt)
    x, y = parity.data()
    model = parity.sequential()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution())],
    )
    assert len(made) >= 3  # one iterator an epoch (Keras makes one more)
    # None was destroyed on the training thread; those destroyed already
    # were destroyed by the reaper (the others wait for their turn: no wait
    # here, a destruction can take over a minute).
    deadline = time.monotonic() + 5
    while not destroyed_on and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "MainThread" not in destroyed_on, destroyed_on
    assert all(
        name.startswith("keras_dist-tf-iterator-reaper") for name in destroyed_on
    ), destroyed_on


class _Views(keras.utils.PyDataset):
    """Batches that are views into the dataset's own arrays, as slicing gives."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // 8

    def __getitem__(self, index: int):
        rows = slice(index * 8, (index + 1) * 8)
        return self.x[rows], self.y[rows]


def _aligned(values: np.ndarray, alignment: int = 64) -> np.ndarray:
    """A copy of `values` whose buffer starts at a multiple of `alignment` bytes
    (TensorFlow takes over the buffer of an aligned NumPy array without copying)."""
    spare = np.empty(values.nbytes + alignment, np.uint8)
    start = -spare.ctypes.data % alignment
    copy = spare[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    copy[...] = values
    return copy


def test_fit_never_writes_into_the_arrays_a_py_dataset_returns():
    """Replica 0's piece of a batch once shared the buffer of the array the
    PyDataset returned (when aligned: about every other run), and a step op
    reusing its input's buffer (`y - y_pred`) wrote into it: the next epochs
    trained on changed targets."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    data = _Views(_aligned(x), _aligned(y))
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    distribution = kd.DataParallel(devices=kd.list_devices())
    model.fit(data, verbose=0, callbacks=[kd.DistributeCallback(distribution)])
    np.testing.assert_array_equal(data.x, x)
    np.testing.assert_array_equal(data.y, y)
