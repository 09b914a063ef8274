"""Every Keras optimizer under `offload="optimizer"` and
`optimizer_state_dtype="bfloat16"`, on DataParallel and FSDP: trained as
without them (offload: the same weights; bfloat16 state: finite losses close
to float32 state's), or refused before any step, naming the optimizer.

Cheap: all the optimizers train at once, one branch of one model each
(`MultiOptimizer` gives each branch's variables its optimizer, inside a
`LossScaleOptimizer`), so each distribution and option compiles one step.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
from keras import ops

import keras_dist as kd

jax_only = pytest.mark.backend("jax")
kopt = keras.optimizers
EPOCHS = 6  # 4 steps each: 24 steps


class SignMomentum(keras.optimizers.Optimizer):
    """A user's optimizer: a slot per variable, its own `update_step`."""

    def build(self, var_list: list) -> None:
        if self.built:
            return
        super().build(var_list)
        self._moments = self.add_optimizer_variables(var_list, "moment")

    def update_step(self, gradient, variable, learning_rate) -> None:
        moment = self._moments[self._get_variable_index(variable)]
        self.assign(moment, 0.9 * moment + 0.1 * gradient)
        step = ops.cast(self.iterations + 1, variable.dtype)
        rate = ops.cast(learning_rate, variable.dtype) / ops.sqrt(step)
        self.assign_sub(variable, rate * ops.sign(moment))


OPTIMIZERS = {
    "SGD": lambda: kopt.SGD(0.05),
    "SGD(momentum, nesterov)": lambda: kopt.SGD(0.05, momentum=0.9, nesterov=True),
    "RMSprop": lambda: kopt.RMSprop(0.01),
    "RMSprop(momentum)": lambda: kopt.RMSprop(0.01, momentum=0.9),
    "RMSprop(centered)": lambda: kopt.RMSprop(0.01, centered=True),
    "Adam": lambda: kopt.Adam(0.01),
    "Adam(amsgrad)": lambda: kopt.Adam(0.01, amsgrad=True),
    "AdamW": lambda: kopt.AdamW(0.01, weight_decay=0.1),
    "Adamax": lambda: kopt.Adamax(0.01),
    "Nadam": lambda: kopt.Nadam(0.01),
    "Adagrad": lambda: kopt.Adagrad(0.05),
    "Adadelta": lambda: kopt.Adadelta(1.0),
    "Adafactor": lambda: kopt.Adafactor(0.01),
    "Ftrl": lambda: kopt.Ftrl(0.05),
    "Lion": lambda: kopt.Lion(0.001),
    "Lamb": lambda: kopt.Lamb(0.01),
    "Muon": lambda: kopt.Muon(0.01),
    "ScheduleFreeAdamW": lambda: kopt.ScheduleFreeAdamW(0.01),
    "SignMomentum (a user's)": lambda: SignMomentum(0.01),
}
OPTIMIZERS = {
    name: make
    for name, make in OPTIMIZERS.items()
    if name.split("(")[0] in dir(kopt) or name.startswith("SignMomentum")
}


def _data(outputs: int) -> tuple:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    return x, [rng.normal(size=(64, 4)).astype("float32") for _ in range(outputs)]


def _model(names: tuple[str, ...]) -> keras.Model:
    """One branch per optimizer (Dense 16-8-4), each with its own loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    outputs = []
    for index in range(len(names)):
        hidden = keras.layers.Dense(8, activation="relu", name=f"b{index}_in")(inputs)
        outputs.append(keras.layers.Dense(4, name=f"b{index}_out")(hidden))
    model = keras.Model(inputs, outputs)
    made = [OPTIMIZERS[name]() for name in names]
    chosen = {f"b{index}_.*": made[index] for index in range(1, len(names))}
    multi = kopt.MultiOptimizer(kopt.OptimizerMap(made[0], chosen))
    model.compile(optimizer=kopt.LossScaleOptimizer(multi), loss=["mse"] * len(names))
    return model


def _distribution(kind: str, **placement: object) -> object:
    if kind == "dp":
        return kd.DataParallel(**placement)
    return kd.FSDP(min_size=16, **placement)


@functools.cache
def _trained(names: tuple[str, ...], kind: str, **placement: object) -> tuple:
    """Each branch's per-epoch losses and weights after `EPOCHS` epochs."""
    model = _model(names)
    start = {
        name: [
            np.asarray(v)
            for v in model.trainable_variables
            if v.path.startswith(f"b{index}_")
        ]
        for index, name in enumerate(names)
    }
    x, y = _data(len(names))
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(_distribution(kind, **placement))],
    )
    losses = {
        name: np.asarray(history.history[f"b{index}_out_loss"])
        for index, name in enumerate(names)
    }
    weights = {
        name: [
            np.asarray(v)
            for v in model.trainable_variables
            if v.path.startswith(f"b{index}_")
        ]
        for index, name in enumerate(names)
    }
    return losses, weights, model, start


NAMES = tuple(OPTIMIZERS)
# bfloat16 state: every epoch's loss within 1% of float32 state's, and every
# weight within 15% of how far float32 state's run moved the weights (measured
# on this model, 24 steps: at most 0.2% and 7.2%, ScheduleFreeAdamW's).
BF16_LOSS_RTOL = 0.01
BF16_WEIGHT_SHARE = 0.15


def _state_slots(model: keras.Model) -> list:
    from keras_dist.keras_compat import optimizers  # noqa: PLC0415

    slots = optimizers.state_slots(model.optimizer, model.trainable_variables)
    return [slot for group in slots.values() for slot in group]


def _largest(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@jax_only
@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_every_optimizer_offloaded_trains_as_on_the_devices(kind):
    losses, weights, _, _ = _trained(NAMES, kind)
    got_losses, got_weights, model, _ = _trained(NAMES, kind, offload="optimizer")
    wrong = {
        name: (_largest(got_weights[name], weights[name]), got_losses[name])
        for name in NAMES
        if not np.all(np.isfinite(got_losses[name]))
        or _largest(got_weights[name], weights[name]) > 1e-6
        or np.max(np.abs(got_losses[name] - losses[name])) > 1e-6
    }
    assert not wrong, f"offloaded, not as on the devices: {wrong}"
    slots = _state_slots(model)
    assert len(slots) > 2 * len(NAMES)
    assert {slot.value.sharding.memory_kind for slot in slots} == {"pinned_host"}
    # Per-step state stays on the devices: the loss scale, Nadam's product.
    nadam = next(
        o
        for o in model.optimizer.inner_optimizer.optimizers
        if isinstance(o, kopt.Nadam)
    )
    assert nadam._u_product.value.sharding.memory_kind == "device"
    assert model.optimizer.dynamic_scale.value.sharding.memory_kind == "device"


@jax_only
@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_every_optimizer_with_bfloat16_state_trains_close_to_float32(kind):
    losses, weights, _, start = _trained(NAMES, kind)
    got_losses, got_weights, model, _ = _trained(
        NAMES, kind, optimizer_state_dtype="bfloat16"
    )
    far = {}
    for name in NAMES:
        moved = _largest(weights[name], start[name])
        off = _largest(got_weights[name], weights[name])
        loss_off = np.max(np.abs(got_losses[name] - losses[name]) / losses[name])
        if (
            not np.all(np.isfinite(got_losses[name]))
            or loss_off > BF16_LOSS_RTOL
            or off > BF16_WEIGHT_SHARE * moved
        ):
            far[name] = (off, moved, loss_off, got_losses[name])
    assert not far, f"bfloat16 state far from float32 state: {far}"
    assert {slot.dtype for slot in _state_slots(model)} == {"bfloat16"}


def _small(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit_small(model: keras.Model, distribution: object = None) -> list:
    x, y = _data(1)
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    history = model.fit(
        x,
        y[0],
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return history.history["loss"]


@jax_only
def test_nadam_alone_logs_the_losses_of_the_run_without_the_options():
    expected = _fit_small(_small(kopt.Nadam(1e-3)), kd.DataParallel())
    offloaded = _fit_small(
        _small(kopt.Nadam(1e-3)), kd.DataParallel(offload="optimizer")
    )
    narrow = _fit_small(
        _small(kopt.Nadam(1e-3)), kd.DataParallel(optimizer_state_dtype="bfloat16")
    )
    np.testing.assert_allclose(offloaded, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(narrow, expected, rtol=BF16_LOSS_RTOL)


class OwnLoop(SignMomentum):
    """A user's optimizer whose update never calls `update_step`."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for gradient, variable in zip(grads, trainable_variables, strict=True):
            self.assign_sub(variable, learning_rate * gradient)


class DirectApply(SignMomentum):
    """A user's optimizer that calls `update_step` from its own apply."""

    def _backend_apply_gradients(self, grads, trainable_variables):
        for gradient, variable in zip(grads, trainable_variables, strict=True):
            self.update_step(gradient, variable, self.learning_rate)


REFUSED = {
    OwnLoop: r"OwnLoop's update does not call update_step for \['sequential",
    DirectApply: r"DirectApply.update_step was called outside its _backend_update",
}


@jax_only
@pytest.mark.parametrize(
    "placement,optimizer",
    [
        ({"offload": "optimizer"}, OwnLoop),
        ({"optimizer_state_dtype": "bfloat16"}, OwnLoop),
        ({"offload": "optimizer"}, DirectApply),
    ],
)
def test_an_update_that_skips_update_step_is_refused_before_any_step(
    placement, optimizer
):
    model = _small(optimizer(0.01))
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match=REFUSED[optimizer]):
        _fit_small(model, kd.DataParallel(**placement))
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(model.optimizer.iterations) == 0
    if "optimizer_state_dtype" in placement:
        # Its slots were made in bfloat16 as the call started: as the error
        # says, a new optimizer for training without the option.
        model.compile(optimizer=optimizer(0.01), loss="mse")
    # Without the option it trains, distributed or not.
    assert np.all(np.isfinite(_fit_small(model, kd.DataParallel())))
    assert np.all(np.isfinite(_fit_small(model)))


def _table() -> str:
    """The docs' table: each optimizer's largest differences from the run
    without the option, on DataParallel and FSDP."""
    rows = [
        '| optimizer | `offload="optimizer"`: weights, DP / FSDP '
        "| bfloat16 state: weights (share of distance trained), DP / FSDP "
        "| bfloat16 state: loss (relative), DP / FSDP |",
        "| --- | --- | --- | --- |",
    ]
    found: dict[str, list[str]] = {name: ["", "", ""] for name in NAMES}
    for kind in ("dp", "fsdp"):
        losses, weights, _, start = _trained(NAMES, kind)
        offloaded = _trained(NAMES, kind, offload="optimizer")
        narrow = _trained(NAMES, kind, optimizer_state_dtype="bfloat16")
        for name in NAMES:
            moved = _largest(weights[name], start[name])
            off = _largest(narrow[1][name], weights[name])
            loss = np.max(np.abs(narrow[0][name] - losses[name]) / losses[name])
            sep = " / " if kind == "fsdp" else ""
            found[name][0] += f"{sep}{_largest(offloaded[1][name], weights[name]):.1g}"
            found[name][1] += f"{sep}{off:.1e} ({off / moved:.1%})"
            found[name][2] += f"{sep}{loss:.1e}"
    rows += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in found.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(_table())
