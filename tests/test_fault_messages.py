"""Small faults get a clear message naming what was wrong (issue 11, item 8)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(monkeypatch, raw):
    monkeypatch.setenv("KERAS_DIST_INIT_TIMEOUT", raw)
    # Refused before anything is contacted (nothing listens at that port).
    with pytest.raises(ValueError, match=f"KERAS_DIST_INIT_TIMEOUT={raw!r}"):
        kd.initialize(job_addresses="127.0.0.1:9", num_processes=2, process_id=0)


def _mesh() -> kd.DeviceMesh:
    devices = kd.list_devices()
    return kd.DeviceMesh((len(devices),), ["batch"], devices)


def test_an_invalid_regex_in_a_keras_layout_map_names_the_key():
    mesh = _mesh()
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense[/kernel"] = (None, None)
    with pytest.raises(ValueError, match=r"'dense\[/kernel' is not a valid one"):
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_a_layout_map_that_matches_no_variable_fails_when_the_call_starts():
    """A map for another model would lay nothing out and train as data
    parallel: refused before any step, and the model is left as it was."""
    layout_map = kd.LayoutMap(_mesh())
    for key in ("kernel", "bias", "embeddings", "gamma"):
        layout_map[f"^other_model/dense/{key}$"] = (None,)
    distribution = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    steps = []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda *_: steps.append(1)
    )
    for call in ("fit", "predict"):
        with pytest.raises(ValueError) as raised:
            if call == "fit":
                model.fit(
                    x,
                    y,
                    batch_size=8,
                    verbose=0,
                    callbacks=[kd.DistributeCallback(distribution), counter],
                )
            else:
                model.predict(
                    x, verbose=0, callbacks=[kd.DistributeCallback(distribution)]
                )
        message = str(raised.value)
        assert message.startswith(
            "None of the 4 LayoutMap keys ('^other_model/dense/kernel$', "
            "'^other_model/dense/bias$', '^other_model/dense/embeddings$' and 1 "
            "more) matches a variable or layer output of model"
        )
        assert "'dense/kernel'" in message and "tensor_parallel(model, mesh)" in message
    assert steps == []
    assert keras.distribution.distribution() is None
    model.fit(x, y, batch_size=8, verbose=0)  # plain Keras, as before


def test_a_layout_map_key_that_matches_nothing_is_named_once():
    layout_map = kd.LayoutMap(_mesh())
    layout_map["dense.*kernel"] = (None, None)
    if keras.backend.backend() != "tensorflow":  # no output relayout on TF
        layout_map["dense/output"] = (None, None)  # a layer output: matched
    layout_map["dnese.*bias"] = (None,)  # a typo: matches nothing
    distribution = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.fit(
                x,
                y,
                batch_size=8,
                verbose=0,
                callbacks=[kd.DistributeCallback(distribution)],
            )
    named = [str(w.message) for w in caught if "LayoutMap key" in str(w.message)]
    assert len(named) == 1, named
    assert "'dnese.*bias'" in named[0] and "dense/kernel" in named[0]
    assert caught[[str(w.message) for w in caught].index(named[0])].category is (
        UserWarning
    )
