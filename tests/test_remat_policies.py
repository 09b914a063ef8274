"""Named remat policies (`remat="dots"`, `"offload"`): what each recomputed
piece keeps for the backward pass. Training equals plain Keras on one device;
the policy shows in what the backward pass keeps (JAX: the residuals of the
loss' gradient, on the device and in host memory) or recomputes (PyTorch: the
floating-point operations of a step)."""

from __future__ import annotations

import warnings

import keras
import pytest

import keras_dist as kd
from keras_dist.distribution.remat import REMAT_POLICIES, RematPolicy
from keras_dist.keras_compat import remat as keras_remat
from keras_dist.keras_compat.layers import layers_of
from tests.test_remat import Block, _assert_same, _data, _fit, _model

BACKEND = keras.backend.backend()


class Policies(keras.callbacks.Callback):
    """Each layer's mode and policy when the first batch starts."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen is None:
            self.seen = {
                layer.name: (
                    getattr(keras_remat.mode_of(layer), "mode", None),
                    keras_remat.policy_of(layer),
                )
                for layer in layers_of(self.model)[1:]
            }


@pytest.fixture(scope="module")
def plain():
    return _fit()


def _cases():
    cases = [("dots", "data_parallel")]
    if BACKEND == "jax":
        cases += [("dots", "fsdp"), ("offload", "data_parallel"), ("offload", "fsdp")]
    return cases


def _distribution(kind, remat):
    if kind == "fsdp":
        return kd.FSDP(min_size=16, remat=remat)
    return kd.DataParallel(remat=remat)


@pytest.mark.backend("jax", "torch")
@pytest.mark.parametrize(("policy", "kind"), _cases())
def test_a_policy_trains_like_plain_keras(policy, kind, plain):
    seen = Policies()
    with warnings.catch_warnings():
        # PyTorch leaves Dropout and BatchNormalization out, and says so.
        warnings.simplefilter("ignore", UserWarning)
        model, history = _fit(_distribution(kind, policy), [seen])
    _assert_same(model, plain[0], history, plain[1])
    # The pieces of "full" (each block whole), each keeping what the policy
    # names; nothing once the call ends.
    assert seen.seen["block_0"] == ("full", policy), seen.seen
    assert seen.seen["block_0_up"] == (None, None), seen.seen
    assert seen.seen["out"] == ("full", policy), seen.seen
    assert all(keras_remat.policy_of(layer) is None for layer in layers_of(model))


@pytest.mark.backend("jax")
def test_a_policy_on_a_list_of_layers_applies_to_those_only(plain):
    seen = Policies()
    scope = RematPolicy("dots", mode="list_of_layers", layer_names=["block_1"])
    model, history = _fit(kd.DataParallel(remat=scope), [seen])
    _assert_same(model, plain[0], history, plain[1])
    assert {name: v for name, v in seen.seen.items() if v[0]} == {
        "block_1": ("list_of_layers", "dots")
    }


def _saved_bytes(remat):
    """Bytes the gradient of the loss of `tests.test_remat`'s model (no
    Dropout or BatchNormalization) keeps from forward to backward, by memory
    space, its layers recomputing as fit under `kd.DataParallel(remat=remat)`
    has them recompute."""
    import jax

    from keras_dist.backends.jax.remat import checkpoint
    from keras_dist.distribution.layer_settings import apply_layer_settings

    model = _model(dropout=False, batch_norm=False)
    x, y = _data()
    undo_modes = apply_layer_settings(
        model, kd.DataParallel(remat=remat), warn=False, recomputes_state=True
    )
    undo_calls = keras_remat.recompute_whole_calls(layers_of(model), checkpoint)
    try:
        trainable = [v.value for v in model.trainable_variables]
        others = [v.value for v in model.non_trainable_variables]
        optimizer = [v.value for v in model.optimizer.variables]

        def loss(trainable, x, y):
            return model.compute_loss_and_updates(
                trainable,
                others,
                [],
                x,
                y,
                None,
                training=True,
                optimizer_variables=optimizer,
            )[0]

        kept = jax.make_jaxpr(lambda *a: jax.vjp(loss, *a)[1])(trainable, x, y)
    finally:
        undo_calls()
        undo_modes()
    saved = {}
    for aval in kept.out_avals:
        space = str(aval.memory_space).rsplit(".", 1)[-1].lower()
        saved[space] = saved.get(space, 0) + aval.size * aval.dtype.itemsize
    return saved


@pytest.mark.backend("jax")
def test_what_each_policy_keeps_for_the_backward_pass():
    saved = {remat: _saved_bytes(remat) for remat in (None, *REMAT_POLICIES)}
    assert all(set(s) == {"device"} for r, s in saved.items() if r != "offload")
    # "dots" keeps the blocks' matrix products on top of what "full" keeps
    # (the pieces' inputs), and less than no remat (every activation).
    assert saved["full"]["device"] < saved["dots"]["device"] < saved[None]["device"], (
        saved
    )
    # "offload" keeps "full"'s on the device and the products in host memory.
    assert saved["offload"]["device"] == saved["full"]["device"], saved
    products = saved["dots"]["device"] - saved["full"]["device"]
    assert saved["offload"]["host"] == products, saved
    # Each of the 2 blocks' up projection of the 40 rows (24 wide, before its
    # bias and gelu): the backward pass of the down projection, its bias and
    # the residual add needs no product of its own.
    assert products == 2 * 40 * 24 * 4, saved


@pytest.mark.backend("torch")
def test_dots_on_pytorch_recomputes_no_matrix_product(plain):
    """The floating-point operations of the fit: "full" runs the blocks'
    products again in backward, "dots" keeps them and adds none."""
    from torch.utils.flop_counter import FlopCounterMode

    flops, calls = {}, {}
    for remat in (None, "full", "dots"):
        Block.calls = 0
        with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
            warnings.simplefilter("ignore", UserWarning)
            model, history = _fit(kd.DataParallel(remat=remat))
        _assert_same(model, plain[0], history, plain[1])
        flops[remat], calls[remat] = counter.get_total_flops(), Block.calls
    assert flops["dots"] == flops[None] < flops["full"], flops
    # Both recompute the blocks' calls in backward: 2 blocks, 3 steps an
    # epoch, 2 epochs.
    assert calls["dots"] == calls["full"] == calls[None] + 2 * 3 * 2, calls


@pytest.mark.backend("torch")
def test_a_policy_pytorch_cannot_run_is_refused():
    with pytest.raises(NotImplementedError, match=r"remat='offload'.*runs on JAX"):
        kd.DataParallel(remat="offload")
    with pytest.raises(NotImplementedError, match=r"remat='offload'.*runs on JAX"):
        kd.FSDP(remat=RematPolicy("offload", mode="larger_than"))
    # A layer given the policy by hand: its recomputed call says so.
    from keras_dist.backends.torch import remat as torch_remat

    layer = keras.layers.Dense(2, name="by_hand")
    keras_remat.set_policy(layer, "offload")
    with pytest.raises(NotImplementedError, match="'offload' of layer 'by_hand'"):
        torch_remat.checkpoint(layer, layer.call)


@pytest.mark.backend("tensorflow")
@pytest.mark.parametrize("remat", ["dots", "offload"])
def test_policies_on_tensorflow_are_refused_when_the_distribution_is_made(remat):
    with pytest.raises(NotImplementedError, match=r"'dots'.*JAX and PyTorch") as info:
        kd.DataParallel(remat=remat)
    assert f"Received: remat={remat!r}" in str(info.value)


@pytest.mark.backend("jax", "torch")
def test_policy_arguments_are_checked():
    with pytest.raises(ValueError, match=r"'dots', 'offload'\].*remat='minimal'"):
        kd.DataParallel(remat="minimal")
    with pytest.raises(TypeError, match=r"'dots', 'offload'\).*remat=1"):
        kd.DataParallel(remat=1)
    with pytest.raises(ValueError, match=r"one of \['full', 'dots', 'offload'\]"):
        RematPolicy("minimal")
    with pytest.raises(ValueError, match="mode='activations'"):
        RematPolicy("dots", mode="activations")
    scope = kd.FSDP(remat="dots").remat
    assert isinstance(scope, keras.RematScope)
    assert (scope.policy, scope.mode) == ("dots", "full")
    assert repr(scope).startswith("RematPolicy(policy='dots', mode='full'")
    # "full" stays Keras' own scope.
    assert type(kd.DataParallel(remat="full").remat) is keras.RematScope
