"""Activation checkpointing: a distribution's `remat=` (Keras' RematScope
modes). Training equals plain Keras on one device and the same distribution
without it; the layers that recompute are the outermost ones whose call
updates no state, for the call only; the ones left out are named."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.keras_compat import remat as keras_remat
from keras_dist.keras_compat.layers import layers_of
from tests.multiprocess import run_job

BACKEND = keras.backend.backend()
ATOL = 1e-5


class Block(keras.layers.Layer):
    """A residual MLP block (a transformer's feed-forward half); counts the
    calls of its own `call`, which remat runs again in the backward pass on
    PyTorch (JAX traces it once)."""

    calls = 0

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(
            4 * width, activation="gelu", name=f"{self.name}_up"
        )
        self.down = keras.layers.Dense(width, name=f"{self.name}_down")

    def call(self, inputs):
        Block.calls += 1
        return inputs + self.down(self.up(inputs))


def _model(dropout: bool = True, batch_norm: bool = True) -> keras.Model:
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,), name="x")
    # BatchNormalization first: after a Dense with a bias, Adam would turn the
    # bias' zero gradient's rounding noise into steps (any two exact runs
    # differ there by 1e-3).
    hidden = inputs
    if batch_norm:
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    hidden = Block(6, name="block_0")(hidden)
    if dropout:
        hidden = keras.layers.Dropout(0.2, name="dropout")(hidden)
    hidden = Block(6, name="block_1")(hidden)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="blocks")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    return x, (x[:, :1] * 2 - x[:, 1:2]).astype("float32")


class Modes(keras.callbacks.Callback):
    """Each layer's rematerialization mode when the first batch starts."""

    def __init__(self):
        super().__init__()
        self.modes = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.modes is None:
            self.modes = {
                layer.name: getattr(keras_remat.mode_of(layer), "mode", None)
                for layer in layers_of(self.model)[1:]
            }


def _fit(distribution=None, callbacks=(), dropout=True, batch_norm=True):
    """Dropout masks depend on the process count on PyTorch: `dropout=False`
    for a job of several processes."""
    model = _model(dropout, batch_norm)
    x, y = _data()
    keras.utils.set_random_seed(5)
    listed = list(callbacks)
    if distribution is not None:
        listed.insert(0, kd.DistributeCallback(distribution))
    history = model.fit(
        x, y, batch_size=16, epochs=2, shuffle=True, verbose=0, callbacks=listed
    )
    return model, history.history


def _assert_same(model, expected_model, history, expected_history):
    for ours, theirs in zip(
        model.get_weights(), expected_model.get_weights(), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, atol=ATOL)


@pytest.fixture(scope="module")
def plain():
    return _fit()


def _distributions():
    if BACKEND == "torch":
        return {"data_parallel": lambda remat: kd.DataParallel(remat=remat)}
    return {
        "data_parallel": lambda remat: kd.DataParallel(remat=remat),
        "fsdp": lambda remat: kd.FSDP(min_size=16, remat=remat),
    }


@pytest.mark.backend("jax", "torch")
@pytest.mark.parametrize("policy", ["data_parallel", "fsdp"])
def test_full_remat_trains_like_plain_keras_and_recomputes_the_outer_blocks(
    policy, plain
):
    if policy not in _distributions():
        pytest.skip("kd.FSDP on PyTorch needs several processes")
    make = _distributions()[policy]
    modes = Modes()
    Block.calls = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, history = _fit(make("full"), [modes])
    calls_with_remat = Block.calls
    _assert_same(model, plain[0], history, plain[1])
    # The blocks as whole pieces (not their Dense layers again), the last
    # Dense; never Dropout or BatchNormalization, which update state.
    assert modes.modes == {
        "x": None,
        "norm": None,
        "block_0": "full",
        "block_0_up": None,
        "block_0_down": None,
        "dropout": None,
        "block_1": "full",
        "block_1_up": None,
        "block_1_down": None,
        "out": "full",
    }, modes.modes
    said = [str(w.message) for w in caught if "remat" in str(w.message)]
    assert len(said) == 1 and "'norm', 'dropout'" in said[0], said
    # Back to an ordinary model after the call.
    assert all(keras_remat.mode_of(layer) is None for layer in model.layers)
    if BACKEND == "torch":
        # PyTorch runs each block's call once more in backward: 2 blocks, 3
        # steps an epoch, 2 epochs (besides the calls that build the model).
        Block.calls = 0
        _fit(make(None))
        assert calls_with_remat - Block.calls == 2 * 3 * 2


@pytest.mark.backend("jax", "torch")
def test_a_list_of_layers_recomputes_those_and_an_unknown_name_is_refused(plain):
    modes = Modes()
    only = keras.RematScope(mode="list_of_layers", layer_names=["block_1"])
    model, history = _fit(kd.DataParallel(remat=only), [modes])
    _assert_same(model, plain[0], history, plain[1])
    assert {name for name, mode in modes.modes.items() if mode} == {"block_1"}

    class Steps(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Steps.steps += 1

    wrong = keras.RematScope(mode="list_of_layers", layer_names=["block_9"])
    with pytest.raises(ValueError, match=r"\['block_9'\] name no layer"):
        _fit(kd.DataParallel(remat=wrong), [Steps()])
    assert Steps.steps == 0
    assert keras.distribution.distribution() is None


@pytest.mark.backend("tensorflow")
def test_remat_on_tensorflow_is_refused_when_the_distribution_is_made():
    with pytest.raises(NotImplementedError, match="JAX and PyTorch"):
        kd.DataParallel(remat="full")
    assert kd.DataParallel(remat=None).remat is None


@pytest.mark.backend("jax", "torch")
def test_remat_arguments_are_checked_when_the_distribution_is_made():
    with pytest.raises(ValueError, match="remat='fulll'"):
        kd.DataParallel(remat="fulll")
    with pytest.raises(ValueError, match="layer_names"):
        kd.DataParallel(remat="list_of_layers")
    with pytest.raises(ValueError, match="layer_names"):
        kd.FSDP(remat=keras.RematScope(mode="list_of_layers"))
    with pytest.raises(TypeError, match="remat=True"):
        kd.DataParallel(remat=True)
    assert kd.DataParallel(remat=keras.RematScope(mode=None)).remat is None
    assert kd.DataParallel().remat is None
    scope = kd.FSDP(remat="activations").remat
    assert isinstance(scope, keras.RematScope) and scope.mode == "activations"


@pytest.mark.backend("torch")
def test_two_processes_with_remat_train_like_plain_keras(tmp_path):
    """2 gloo processes, each block recomputed in backward, under DDP, kd.FSDP
    (DTensor compute, and plain compute as FSDP2 without BatchNormalization)
    and a ModelParallel splitting the blocks' kernels: a recomputed layer
    gathers its split variables again."""
    results = run_job(
        "remat_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    plain = {}
    for batch_norm in (True, False):
        Block.calls = 0
        plain[batch_norm] = (*_fit(dropout=False, batch_norm=batch_norm), Block.calls)
    for result in results:
        assert set(result) == {"ddp", "fsdp", "fsdp_plain_compute", "model_parallel"}
        for name, fit in result.items():
            plain_model, plain_history, plain_calls = plain[fit["batch_norm"]]
            for ours, theirs in zip(
                fit["weights"], plain_model.get_weights(), strict=True
            ):
                np.testing.assert_allclose(
                    ours, theirs, atol=ATOL, rtol=0, err_msg=name
                )
            for key, values in plain_history.items():
                np.testing.assert_allclose(
                    fit["history"][key], values, atol=ATOL, err_msg=name
                )
            # Each process recomputes its blocks: 2 blocks, 3 steps an epoch,
            # 2 epochs more than the plain fit.
            assert fit["calls"] - plain_calls == 12, name
