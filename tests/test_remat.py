"""Activation checkpointing: a distribution's `remat=` (Keras' RematScope
modes). Training equals plain Keras on one device and the same distribution
without it; the layers that recompute are the outermost ones, for the call
only. On JAX a layer whose call updates state (Dropout, the noise layers,
BatchNormalization) recomputes too, drawing the same random numbers; on
PyTorch it is left out, and named."""

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
    # Dense; on PyTorch never Dropout or BatchNormalization, which update
    # state (JAX recomputes them exactly).
    stateful = "full" if BACKEND == "jax" else None
    assert modes.modes == {
        "x": None,
        "norm": stateful,
        "block_0": "full",
        "block_0_up": None,
        "block_0_down": None,
        "dropout": stateful,
        "block_1": "full",
        "block_1_up": None,
        "block_1_down": None,
        "out": "full",
    }, modes.modes
    said = [str(w.message) for w in caught if "remat" in str(w.message)]
    if BACKEND == "jax":
        assert said == []
    else:
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
    gathers its split variables again (with `remat="dots"` too, keeping its
    matrix products)."""
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
        assert set(result) == {
            "ddp",
            "fsdp",
            "fsdp_plain_compute",
            "model_parallel",
            "fsdp_dots",
        }
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


# -- layers with a training flag or a seed, inside a recomputed block ----------
class Holding(keras.layers.Layer):
    """A residual block with `inner` in its middle, called with the block's
    `training` (as a KerasHub decoder block calls its Dropout layers). The
    Dense before it has no bias: a bias before BatchNormalization gets a zero
    gradient whose rounding noise Adam turns into steps."""

    def __init__(self, inner: keras.layers.Layer, width: int, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(4 * width, use_bias=False, name="up")
        self.inner = inner
        self.down = keras.layers.Dense(width, name="down")

    def call(self, inputs, training=None):
        hidden = self.inner(self.up(inputs), training=training)
        return inputs + self.down(keras.activations.gelu(hidden))


INNER_LAYERS = {
    "dropout_0": lambda: keras.layers.Dropout(0.0, name="inner"),
    "dropout_seeded": lambda: keras.layers.Dropout(0.1, seed=7, name="inner"),
    "gaussian_noise": lambda: keras.layers.GaussianNoise(0.3, seed=7, name="inner"),
    "gaussian_dropout": lambda: keras.layers.GaussianDropout(0.2, seed=7, name="inner"),
    "alpha_dropout": lambda: keras.layers.AlphaDropout(0.2, seed=7, name="inner"),
    "batch_norm": lambda: keras.layers.BatchNormalization(name="inner"),
    # A loss added inside the recomputed block (`add_loss`).
    "activity_regularizer": lambda: keras.layers.Dense(
        24, activity_regularizer=keras.regularizers.L2(0.01), name="inner"
    ),
}


def _holding_model(inner: str) -> keras.Model:
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,), name="x")
    hidden = Holding(INNER_LAYERS[inner](), 6, name="holding")(inputs)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="holding_model")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _fit_model(model, distribution, callbacks=(), **data):
    x, y = data.pop("x", None), data.pop("y", None)
    if x is None:
        x, y = _data()
    keras.utils.set_random_seed(5)
    history = model.fit(
        x,
        y,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), *callbacks],
        **{"batch_size": 16, **data},
    )
    return history.history


def _assert_same_variables(model, expected_model, history, expected_history):
    """Every variable (seed generators' states included: the same random
    numbers were drawn, as many times) and every logged value."""
    for ours, theirs in zip(model.variables, expected_model.variables, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours.value).astype("float64"),
            keras.ops.convert_to_numpy(theirs.value).astype("float64"),
            atol=ATOL,
            rtol=0,
            err_msg=ours.path,
        )
    assert history.keys() == expected_history.keys()
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, atol=ATOL, err_msg=key)


@pytest.mark.backend("jax", "torch")
@pytest.mark.parametrize("inner", list(INNER_LAYERS))
def test_a_block_holding_a_layer_with_a_training_flag_or_a_seed_recomputes_exactly(
    inner,
):
    """The block's Python `training` reaches the layer inside as it was passed
    (JAX: static through `jax.checkpoint`), its seed generator draws the masks
    and noise of the fit without remat and advances as often, its moving
    statistics and losses come out of the recomputed block."""
    expected_model = _holding_model(inner)
    expected = _fit_model(expected_model, kd.DataParallel())
    model = _holding_model(inner)
    modes = Modes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit_model(model, kd.DataParallel(remat="full"), [modes])
    _assert_same_variables(model, expected_model, history, expected)
    said = [str(w.message) for w in caught if "remat" in str(w.message)]
    holds_state = bool(model.get_layer("holding").inner.non_trainable_variables)
    if BACKEND == "jax" or not holds_state:
        # The block recomputes as one piece, the layer inside it with it.
        assert modes.modes["holding"] == "full", modes.modes
        assert said == []
    else:
        # PyTorch runs the recomputed call again: a second draw of the seed, a
        # second update of the statistics. Left out, and said.
        assert modes.modes["holding"] is None
        assert modes.modes["up"] == modes.modes["down"] == "full", modes.modes
        assert len(said) == 1 and said[0].endswith("training stays exact: 'inner'")
    assert modes.modes["out"] == "full"


class HiddenRegularized(keras.layers.Layer):
    """Calls a layer it does not track (not one of its sublayers), which adds
    a loss: no owner the recomputed call can hand the loss back to."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.__dict__["hidden"] = keras.layers.ActivityRegularization(l2=0.01)

    def call(self, inputs):
        return self.hidden(inputs)


@pytest.mark.backend("jax")
def test_a_layer_remat_cannot_recompute_is_an_error_naming_it():
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,))
    hidden = HiddenRegularized(name="hides_its_regularizer")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"cannot recompute layer 'hides_its_reg"):
        _fit_model(model, kd.DataParallel(remat="full"))
    assert keras.distribution.distribution() is None


# -- KerasHub decoders ----------------------------------------------------------
def _causal_lm(kind: str) -> keras.Model:
    """A tiny KerasHub causal LM of `kind` built from its config (no
    download): 2 layers, width 16. Their decoder blocks hold Dropout layers
    (rate 0 in Gemma and Llama, 0.1 here in GPT2)."""
    keras_hub = pytest.importorskip("keras_hub")
    models = keras_hub.models
    keras.utils.set_random_seed(3)
    sizes = {"vocabulary_size": 64, "num_layers": 2, "hidden_dim": 16}
    sizes["intermediate_dim"] = 32
    heads = {"num_query_heads": 2, "num_key_value_heads": 1}
    if kind == "gemma":
        backbone = models.GemmaBackbone(head_dim=8, **heads, **sizes)
        model = models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    elif kind == "llama":
        backbone = models.LlamaBackbone(**heads, **sizes)
        model = models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = models.GPT2Backbone(
            num_heads=2, max_sequence_length=8, dropout=0.1, **sizes
        )
        model = models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def _tokens():
    tokens = np.random.default_rng(0).integers(1, 64, size=(16, 9))
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), bool)}
    return x, tokens[:, 1:]


@pytest.mark.backend("jax")
@pytest.mark.parametrize(
    ("kind", "policy"),
    [("gemma", "fsdp"), ("llama", "data_parallel"), ("gpt2", "fsdp")],
)
def test_keras_hub_decoders_train_with_remat_as_without(kind, policy):
    make = _distributions()[policy]
    x, y = _tokens()
    expected_model = _causal_lm(kind)
    expected = _fit_model(expected_model, make(None), x=x, y=y, batch_size=8)
    model = _causal_lm(kind)
    modes = Modes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit_model(model, make("full"), [modes], x=x, y=y, batch_size=8)
    _assert_same_variables(model, expected_model, history, expected)
    assert [str(w.message) for w in caught if "remat" in str(w.message)] == []
    # Not the backbone as one piece (recomputed whole, it would rebuild all
    # its activations at once and save nothing at the peak): its own layers,
    # each decoder block (Dropout layers and all) and the token embedding
    # (also the LM's head, reversed).
    recomputed = {name for name, mode in modes.modes.items() if mode}
    blocks = {
        layer.name
        for layer in model.backbone.layers
        if layer.name.startswith(("decoder_block_", "transformer_layer_"))
    }
    assert len(blocks) == 2, [layer.name for layer in model.backbone.layers]
    assert blocks | {model.backbone.token_embedding.name} <= recomputed, recomputed
    # Nothing inside a block again, nor the backbone whole.
    assert recomputed <= {layer.name for layer in model.backbone.layers}, recomputed
