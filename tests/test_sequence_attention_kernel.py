"""Which attention kernel a call with a sequence axis runs (JAX, 8 devices).

Keras' `MultiHeadAttention` reads `keras.config.is_flash_attention_enabled()`
when it is made, and a layer made with no choice lets the backend pick the
kernel at each call (Splash attention on TPU, a Mosaic kernel XLA cannot
split along a sequence axis). A call with a sequence axis longer than 1 gives
such a layer XLA's attention for the call; an axis of size 1 changes no
layer."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.distribution.sequence import split_sequence
from keras_dist.keras_compat.layers import flash_attention_choice, xla_attention
from tests.untouched import Untouched

pytestmark = pytest.mark.backend("jax")


def _decoder(flash_attention=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Embedding(16, 8)(tokens)
    attended = keras.layers.MultiHeadAttention(
        2, 4, flash_attention=flash_attention, name="attention"
    )(hidden, hidden, use_causal_mask=True)
    model = keras.Model(tokens, keras.layers.Dense(16)(hidden + attended))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _distribution(shape) -> kd.DataParallel:
    return kd.DataParallel(kd.DeviceMesh(shape, ["batch", "seq"]), sequence_axis="seq")


class _Kernels(keras.callbacks.Callback):
    """The attention layer's flash-attention setting at each step."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(flash_attention_choice(self.layer))


def test_a_layer_with_no_choice_runs_xla_attention_for_the_call():
    assert keras.config.is_flash_attention_enabled() is None
    model = _decoder()
    layer = model.get_layer("attention")
    assert flash_attention_choice(layer) is None
    kernels = _Kernels(layer)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (8, 8)).astype("int32")
    model.fit(
        x,
        x,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution((2, 4))), kernels],
    )
    assert kernels.seen == [False, False]
    # Undone with the call: the layer and Keras' setting as they were.
    assert flash_attention_choice(layer) is None
    assert keras.config.is_flash_attention_enabled() is None


def test_a_layer_that_chose_keeps_its_choice_and_true_is_refused():
    # Keras keeps False only from the global setting (`flash_attention=False`
    # alone leaves the choice to the backend).
    keras.config.disable_flash_attention()
    try:
        model = _decoder()
    finally:
        keras.config.enable_flash_attention()
    undo = split_sequence(model, _distribution((2, 4)))
    assert flash_attention_choice(model.get_layer("attention")) is False
    undo()
    assert flash_attention_choice(model.get_layer("attention")) is False
    with pytest.raises(ValueError, match="built with flash_attention=True"):
        split_sequence(_decoder(flash_attention=True), _distribution((2, 4)))


def test_an_axis_of_size_one_changes_no_layer():
    for choice in (None, True):
        model = _decoder(flash_attention=choice)
        undo = split_sequence(model, _distribution((8, 1)))
        assert flash_attention_choice(model.get_layer("attention")) is choice
        assert keras.config.is_flash_attention_enabled() is None
        undo()
        assert flash_attention_choice(model.get_layer("attention")) is choice


def test_xla_attention_leaves_a_layer_without_the_setting():
    assert xla_attention(keras.layers.Dense(2)) is None
    assert flash_attention_choice(keras.layers.Dense(2)) is None


class _OwnAttention(keras.layers.Layer):
    """An attention layer with query, key and value projections that calls
    the op itself, asking for the flash kernel."""

    def __init__(self, flash_attention, **kwargs):
        super().__init__(**kwargs)
        self.flash_attention = flash_attention
        self.query_dense = keras.layers.Dense(8)
        self.key_dense = keras.layers.Dense(8)
        self.value_dense = keras.layers.Dense(8)

    def build(self, input_shape):
        for projection in (self.query_dense, self.key_dense, self.value_dense):
            projection.build(input_shape)

    def call(self, hidden):
        def heads(x):
            return keras.ops.reshape(x, (-1, keras.ops.shape(x)[1], 2, 4))

        attended = keras.ops.dot_product_attention(
            heads(self.query_dense(hidden)),
            heads(self.key_dense(hidden)),
            heads(self.value_dense(hidden)),
            is_causal=True,
            flash_attention=self.flash_attention,
        )
        return keras.ops.reshape(attended, (-1, keras.ops.shape(hidden)[1], 8))


def _own_attention_model(flash_attention) -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Embedding(16, 8)(tokens)
    attended = _OwnAttention(flash_attention, name="own")(hidden)
    model = keras.Model(tokens, keras.layers.Dense(16)(hidden + attended))
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_flash_attention_true_at_the_op_is_refused_naming_the_axis():
    x = np.random.default_rng(0).integers(0, 16, (8, 8)).astype("int32")
    # Built with the choice left to Keras (on this CPU Keras itself refuses
    # True), then asking for the kernel in the call.
    model = _own_attention_model(flash_attention=None)
    model.get_layer("own").flash_attention = True
    before = Untouched(model)
    with pytest.raises(ValueError, match="flash_attention=True during a call") as error:
        model.predict(
            x,
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(_distribution((2, 4)))],
        )
    assert "along 'seq'" in str(error.value)
    # Refused while the step was traced: the model and Keras' kernel choice
    # are as they were, and plain Keras predicts.
    before.check()
    model.get_layer("own").flash_attention = None
    assert model.predict(x, batch_size=8, verbose=0).shape == (8, 8, 16)
    # Left to Keras (None), the same layer trains: XLA's attention.
    model.fit(
        x,
        x,
        batch_size=8,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution((2, 4)))],
    )


def test_a_failure_while_splitting_undoes_what_was_changed(monkeypatch):
    from keras_dist.backends.jax import sequence as jax_sequence  # noqa: PLC0415

    def fails(axis):
        raise RuntimeError("the kernel choice could not be patched")

    monkeypatch.setattr(jax_sequence, "xla_attention_only", fails)
    model = _decoder()
    layer = model.get_layer("attention")
    calls = {id(each): each.call for each in (layer, layer._query_dense)}
    with pytest.raises(RuntimeError, match="could not be patched"):
        split_sequence(model, _distribution((2, 4)))
    assert flash_attention_choice(layer) is None
    assert keras.config.is_flash_attention_enabled() is None
    for each in (layer, layer._query_dense):
        assert each.call == calls[id(each)]
