"""Batches made ahead on threads (`keras_dist.common.prefetch`, issue 39).

The prefetcher itself (order, errors, no thread outliving its iterator, the
`KERAS_DIST_PREFETCH_BATCHES` setting), and JAX training with batches made
ahead (the default on accelerators; forced here on the CPU) giving exactly
what training without it gives.
"""

from __future__ import annotations

import gc
import threading
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.common import prefetch
from keras_dist.common.prefetch import Prefetcher, prefetch_depth


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("keras_dist-")]


def _wait_for_no_threads(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


@pytest.mark.backend_neutral
def test_batches_come_out_made_and_in_order():
    made = list(Prefetcher(iter(range(50)), lambda batch: batch * 10, depth=2))
    assert made == [batch * 10 for batch in range(50)]
    assert _wait_for_no_threads() == []


@pytest.mark.backend_neutral
def test_an_error_of_the_source_comes_after_the_batches_before_it():
    def source():
        yield from range(3)
        raise OSError("disk gone")

    batches = Prefetcher(source(), lambda batch: batch, depth=2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="disk gone"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)


@pytest.mark.backend_neutral
def test_an_error_of_make_is_raised_by_the_next_that_would_return_it():
    def make(batch):
        if batch == 4:
            raise ValueError("bad batch 4")
        return batch

    batches = Prefetcher(iter(range(10)), make, depth=1)
    assert [next(batches) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="bad batch 4"):
        next(batches)


@pytest.mark.backend_neutral
def test_close_ends_threads_blocked_on_full_queues():
    batches = Prefetcher(iter(range(1000)), lambda batch: batch, depth=1)
    assert next(batches) == 0
    time.sleep(0.1)  # both stages are now blocked on full queues
    assert batches.alive
    batches.close(timeout=2)
    assert not batches.alive
    with pytest.raises(StopIteration):
        next(batches)


@pytest.mark.backend_neutral
def test_a_dropped_prefetcher_ends_its_threads():
    """An epoch's iterator Keras drops (an epoch cut short, a run stopped):
    its threads hold no reference to it, and end."""
    batches = Prefetcher(iter(range(1000)), lambda batch: batch, depth=1)
    next(batches)
    del batches
    gc.collect()
    assert _wait_for_no_threads() == []


@pytest.mark.backend_neutral
def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth >= 1. Received: 0"):
        Prefetcher(iter(()), lambda batch: batch, depth=0)


@pytest.mark.backend_neutral
def test_depth_defaults_to_two_on_accelerators_running_several_steps(monkeypatch):
    monkeypatch.delenv(prefetch.PREFETCH_VARIABLE, raising=False)
    # Where the chip measured the threads faster than Keras' own loop.
    assert prefetch_depth("tpu", 16) == prefetch.ACCELERATOR_DEPTH == 2
    assert prefetch_depth("gpu", 2) == 2
    # One step an execution (the main thread busy at every step) and CPUs:
    # each batch made when the step asks for it.
    assert prefetch_depth("tpu", 1) == 0
    assert prefetch_depth("tpu") == 0
    assert prefetch_depth("cpu", 16) == 0
    # The variable wins either way.
    monkeypatch.setenv(prefetch.PREFETCH_VARIABLE, "0")
    assert prefetch_depth("tpu", 16) == 0
    monkeypatch.setenv(prefetch.PREFETCH_VARIABLE, "3")
    assert prefetch_depth("cpu") == 3
    assert prefetch_depth("tpu", 1) == 3


@pytest.mark.backend_neutral
@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_prefetch_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(prefetch.PREFETCH_VARIABLE, value)
    with pytest.raises(
        ValueError, match=f"KERAS_DIST_PREFETCH_BATCHES={value!r}".replace(".", r"\.")
    ):
        prefetch_depth("tpu")


# -- JAX training with batches made ahead ---------------------------------------
def _model() -> keras.Model:
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _train(monkeypatch, depth: int) -> tuple[list, dict, np.ndarray, dict]:
    monkeypatch.setenv(prefetch.PREFETCH_VARIABLE, str(depth))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(90, 6)).astype("float32")
    y = rng.integers(0, 3, size=(90,)).astype("int32")
    model = _model()
    distribution = kd.DataParallel()
    callbacks = [kd.DistributeCallback(distribution)]
    keras.utils.set_random_seed(11)
    history = model.fit(
        x,
        y,
        batch_size=16,  # the last batch, 10 rows, is padded to 16 and masked
        epochs=3,
        shuffle=True,
        validation_data=(x[:20], y[:20]),
        verbose=0,
        callbacks=callbacks,
    ).history
    generator = ((x[i : i + 16], y[i : i + 16]) for i in range(0, 90, 16))
    model.fit(generator, epochs=1, verbose=0, callbacks=callbacks)
    predictions = model.predict(x, batch_size=16, verbose=0, callbacks=callbacks)
    evaluated = model.evaluate(
        x, y, batch_size=16, verbose=0, return_dict=True, callbacks=callbacks
    )
    return model.get_weights(), history, predictions, evaluated


@pytest.mark.backend("jax")
def test_training_with_batches_made_ahead_equals_training_without(monkeypatch):
    weights, history, predictions, evaluated = _train(monkeypatch, 0)
    assert _threads() == []
    ahead = _train(monkeypatch, 2)
    for ours, reference in zip(ahead[0], weights, strict=True):
        np.testing.assert_array_equal(ours, reference)
    assert ahead[1] == history
    np.testing.assert_array_equal(ahead[2], predictions)
    assert ahead[2].shape == (90, 3)
    assert ahead[3] == evaluated
    # No thread outlives the run that made batches ahead.
    assert _wait_for_no_threads() == []


@pytest.mark.backend("jax")
def test_an_error_reading_ahead_is_raised_by_fit_and_leaves_no_thread(monkeypatch):
    monkeypatch.setenv(prefetch.PREFETCH_VARIABLE, "2")
    model = _model()

    def batches():
        rng = np.random.default_rng(0)
        for _ in range(3):
            yield rng.normal(size=(16, 6)).astype("float32"), np.zeros(16, "int32")
        raise RuntimeError("the reader broke at batch 3")

    with pytest.raises(RuntimeError, match="the reader broke at batch 3"):
        model.fit(
            batches(),
            epochs=1,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    assert _wait_for_no_threads() == []
    # The model and plain Keras are usable after it.
    model.fit(np.zeros((16, 6), "float32"), np.zeros(16, "int32"), verbose=0)
