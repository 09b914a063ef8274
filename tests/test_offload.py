"""`offload=` and `optimizer_state_dtype=`: the optimizer's slots in pinned host
memory, in a low-precision dtype, trained as without them."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.conftest import BACKEND
from tests.untouched import Untouched

jax_only = pytest.mark.backend("jax")
STATE = ("momentum", "velocity")


def _data(rows: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype("float32")
    return x, rng.normal(size=(rows, 4)).astype("float32")


def _model(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32),
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _distribution(kind: str, **placement: object) -> object:
    if kind == "dp":
        return kd.DataParallel(**placement)
    if kind == "fsdp":
        return kd.FSDP(min_size=16, **placement)
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    return kd.ModelParallel(layout_map=layout_map, **placement)


def _state_slots(model: keras.Model) -> list:
    return [v for v in model.optimizer.variables if v.name.endswith(STATE)]


class _MemoryKinds(keras.callbacks.Callback):
    """The memory kinds of the state slots, read during fit."""

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.kinds = {
            v.value.sharding.memory_kind
            for v in self.model.optimizer.variables
            if v.name.endswith(STATE) or "velocity" in v.name
        }


def _fit(model: keras.Model, distribution: object, epochs: int = 1, **kw) -> list:
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), *kw.pop("callbacks", [])],
        **kw,
    )
    return [np.asarray(w) for w in model.weights]


# -- the arguments -------------------------------------------------------------
@jax_only
@pytest.mark.parametrize("kind", ["dp", "fsdp", "mp"])
def test_the_distributions_say_where_the_state_lives(kind):
    distribution = _distribution(
        kind, offload="optimizer", optimizer_state_dtype="bfloat16"
    )
    assert distribution.offload == "optimizer"
    assert distribution.optimizer_state_dtype == "bfloat16"
    assert distribution.state_placement.slot_memory == "pinned_host"
    plain = _distribution(kind)
    assert plain.offload is None and plain.optimizer_state_dtype is None
    assert plain.state_placement is None


@jax_only
def test_a_wrong_offload_is_refused_listing_the_allowed_ones():
    with pytest.raises(ValueError, match=r"one of \[None, 'optimizer'\].*'params'"):
        kd.DataParallel(offload="params")
    with pytest.raises(ValueError, match=r"one of \[None, 'optimizer'\].*=True"):
        kd.FSDP(offload=True)
    with pytest.raises(NotImplementedError, match="offload='optimizer'"):
        kd.FSDP(offload="optimizer+params")


@jax_only
@pytest.mark.parametrize("dtype", ["int8", "nonsense", 3])
def test_a_state_dtype_that_is_no_float_is_refused(dtype):
    with pytest.raises(ValueError, match="optimizer_state_dtype="):
        kd.DataParallel(optimizer_state_dtype=dtype)


@jax_only
def test_with_options_changes_where_the_state_lives():
    base = kd.DataParallel()
    twin = base.with_options(offload="optimizer", optimizer_state_dtype="bfloat16")
    assert (twin.offload, twin.optimizer_state_dtype) == ("optimizer", "bfloat16")
    assert (base.offload, base.optimizer_state_dtype) == (None, None)
    assert twin.with_options(offload=None).offload is None
    with pytest.raises(TypeError, match="with_options takes"):
        base.with_options(batch_size=2)


@pytest.mark.backend("torch", "tensorflow")
@pytest.mark.parametrize(
    "placement", [{"offload": "optimizer"}, {"optimizer_state_dtype": "bfloat16"}]
)
def test_other_backends_refuse_it_at_construction_saying_what_works(placement):
    why = "DTensor, not FSDP2's `fully_shard`" if BACKEND == "torch" else "JAX"
    for make in (kd.DataParallel, kd.FSDP):
        with pytest.raises(NotImplementedError, match=re.escape(why)):
            make(**placement)


# -- training as without offload -------------------------------------------------
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
}


@jax_only
@pytest.mark.parametrize(
    "kind,name",
    [
        ("dp", "adam"),
        ("fsdp", "adamw"),
        ("mp", "sgd"),
        ("dp", "lion"),
        ("fsdp", "adafactor"),
    ],
)
def test_offloaded_training_equals_training_on_the_devices(kind, name):
    expected = _fit(_model(OPTIMIZERS[name]()), _distribution(kind))
    model = _model(OPTIMIZERS[name]())
    kinds = _MemoryKinds()
    weights = _fit(model, _distribution(kind, offload="optimizer"), callbacks=[kinds])
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert kinds.kinds == {"pinned_host"}
    slots = [v for v in model.optimizer.variables if v.name.endswith(STATE)]
    assert {v.value.sharding.memory_kind for v in slots} <= {"pinned_host"}
    # The step counter and learning rate stay on the devices.
    assert model.optimizer.iterations.value.sharding.memory_kind == "device"


@jax_only
@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_gradient_accumulation_offloaded_equals_it_on_the_devices(kind):
    def optimizer():
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)

    expected = _fit(_model(optimizer()), _distribution(kind), epochs=2)
    model = _model(optimizer())
    weights = _fit(model, _distribution(kind, offload="optimizer"), epochs=2)
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    accumulators = [v for v in model.optimizer.variables if "accumulator" in v.name]
    assert accumulators
    assert {v.value.sharding.memory_kind for v in accumulators} == {"device"}


def _lowered_train_step(model: keras.Model, distribution: object) -> str:
    import jax  # noqa: PLC0415

    from keras_dist.backends import get_adapter  # noqa: PLC0415
    from keras_dist.backends.jax import (
        compiled_plan,  # noqa: PLC0415
        keras_internals,  # noqa: PLC0415
    )

    adapter = get_adapter()
    state = compiled_plan.state_structs(model, distribution)
    batch = compiled_plan.batch_structs(
        distribution,
        (
            jax.ShapeDtypeStruct((16, 16), np.float32),
            jax.ShapeDtypeStruct((16, 4), np.float32),
        ),
    )
    with distribution.scope():
        adapter._install_steps(model, distribution)
        try:
            step = keras_internals.keras_step_function(
                model, "train", compiled_plan._sharding_tree(state)
            )
            return step.lower(state, batch).as_text()
        finally:
            adapter.deactivate(model)


@jax_only
def test_the_compiled_step_brings_each_variables_slots_in_after_the_last():
    lowered = {}
    for offload in (None, "optimizer"):
        for steps in (None, 2):
            model = _model(keras.optimizers.Adam(gradient_accumulation_steps=steps))
            distribution = kd.DataParallel(offload=offload)
            _fit(model, distribution, epochs=1)
            lowered[offload, steps] = _lowered_train_step(model, distribution)
    variables = len(model.trainable_variables)
    text = lowered["optimizer", None]
    # Both moments of every variable are pinned_host arguments and results.
    arguments = re.findall(r"%arg\d+: tensor<[^>]*> \{([^}]*)\}", text)
    assert sum('"pinned_host"' in a for a in arguments) == 2 * variables
    assert text.count('_xla_buffer_placement = "pinned_host"') == 2 * variables
    # Chained: each variable's slots wait for the previous one's.
    assert text.count("stablehlo.optimization_barrier") == variables - 1
    assert "optimization_barrier" not in lowered[None, None]
    # Under accumulation each variable's update (and its transfers) is a branch
    # of its own conditional on the update step.
    extra = lowered["optimizer", 2].count("stablehlo.case") - lowered[None, 2].count(
        "stablehlo.case"
    )
    assert extra == variables


@jax_only
def test_evaluate_and_predict_run_with_the_state_offloaded():
    x, y = _data()
    plain = _model(keras.optimizers.Adam(0.01))
    offloaded = _model(keras.optimizers.Adam(0.01))
    _fit(plain, kd.DataParallel(), epochs=1)
    _fit(offloaded, kd.DataParallel(offload="optimizer"), epochs=1)
    results = []
    for model, distribution in (
        (plain, kd.DataParallel()),
        (offloaded, kd.DataParallel(offload="optimizer")),
    ):
        callbacks = [kd.DistributeCallback(distribution)]
        loss = model.evaluate(x, y, batch_size=16, verbose=0, callbacks=callbacks)
        predictions = model.predict(x, batch_size=16, verbose=0, callbacks=callbacks)
        results.append((loss, predictions))
    assert results[1][0] == pytest.approx(results[0][0], abs=1e-6)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-6)
    assert {v.value.sharding.memory_kind for v in _state_slots(offloaded)} == {
        "pinned_host"
    }


@jax_only
def test_a_checkpoint_of_offloaded_state_saves_and_restores_it(tmp_path):
    def run(offload, directory, epochs):
        model = _model(keras.optimizers.Adam(0.01))
        distribution = kd.FSDP(min_size=16, offload=offload)
        checkpoint = kd.Checkpoint(
            directory, save_freq="epoch", save_on_background=False
        )
        _fit(model, distribution, epochs=epochs, callbacks=[checkpoint])
        return model

    plain = run(None, tmp_path / "plain", 1)
    offloaded = run("optimizer", tmp_path / "offloaded", 1)
    for a, b in zip(
        plain.optimizer.variables, offloaded.optimizer.variables, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Saved alike: restored into fresh models, the state is the same.
    restored = []
    for name in ("plain", "offloaded"):
        model = _model(keras.optimizers.Adam(0.01))
        model.optimizer.build(model.trainable_variables)
        assert kd.restore(model, str(tmp_path / name)) == 2
        restored.append([np.asarray(v) for v in model.optimizer.variables])
    for a, b in zip(*restored, strict=True):
        np.testing.assert_array_equal(a, b)
    # A run resumed from the offloaded checkpoint goes on as one straight run.
    straight = run(None, tmp_path / "straight", 2)
    resumed = run("optimizer", tmp_path / "offloaded", 2)
    for a, b in zip(straight.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert {v.value.sharding.memory_kind for v in _state_slots(resumed)} == {
        "pinned_host"
    }


# -- the state in bfloat16 ------------------------------------------------------
# Measured: 2 epochs (4 steps) of Adam(0.01) on this model, the weights of
# bfloat16 state differ from float32 state's by at most 9.7e-5.
class _TrainerNet(kd.Trainer, keras.Model):
    pass


def _trainer_model(distribution: object) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(4)(keras.layers.Dense(32)(hidden))
    model = _TrainerNet(inputs, outputs, distribution=distribution)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@jax_only
def test_offload_with_remat_mixed_precision_the_trainer_and_a_second_fit():
    """`remat="dots"`, `mixed_precision=` and `kd.Trainer` together, and a
    second `fit` of the same model: as the same runs without offload."""
    runs = []
    for offload in (None, "optimizer"):
        distribution = kd.FSDP(
            min_size=16, remat="dots", mixed_precision="bfloat16", offload=offload
        )
        model = _trainer_model(distribution)
        x, y = _data()
        fits = []
        for _ in range(2):
            model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
            fits.append([np.asarray(w) for w in model.weights])
        runs.append(fits)
    for ours, expected in zip(runs[1], runs[0], strict=True):
        for got, want in zip(ours, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.array_equal(runs[1][0][0], runs[1][1][0])  # the second trained


@jax_only
def test_a_plain_keras_fit_after_an_offloaded_one_trains_as_without_it():
    """The slots stay in host memory after the offloaded `fit`; a plain Keras
    `fit` brings them back to the devices, where Keras' own step reads them."""
    x, y = _data()
    runs = []
    for offload in (None, "optimizer"):
        model = _model(keras.optimizers.Adam(0.01))
        _fit(model, kd.DataParallel(offload=offload))
        if offload:
            assert {v.value.sharding.memory_kind for v in _state_slots(model)} == {
                "pinned_host"
            }
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        runs.append([np.asarray(w) for w in model.weights])
    for got, want in zip(runs[1], runs[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert {v.value.sharding.memory_kind for v in _state_slots(model)} == {"device"}


BF16_TOLERANCE = 1e-3


@jax_only
@pytest.mark.parametrize("offload", [None, "optimizer"])
def test_bfloat16_state_trains_close_to_float32_state(offload, tmp_path):
    expected = _fit(_model(keras.optimizers.Adam(0.01)), kd.DataParallel(), epochs=2)
    model = _model(keras.optimizers.Adam(0.01))
    distribution = kd.DataParallel(offload=offload, optimizer_state_dtype="bfloat16")
    checkpoint = kd.Checkpoint(tmp_path, save_freq="epoch", save_on_background=False)
    weights = _fit(model, distribution, epochs=2, callbacks=[checkpoint])
    assert {v.dtype for v in _state_slots(model)} == {"bfloat16"}
    assert {str(v.value.dtype) for v in _state_slots(model)} == {"bfloat16"}
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=BF16_TOLERANCE)
    assert not np.array_equal(weights[0], expected[0])  # the dtype did act
    # Round trip: a fresh model's run resumes from the checkpoint's slots.
    fresh = _model(keras.optimizers.Adam(0.01))
    checkpoint = kd.Checkpoint(tmp_path, save_freq="epoch", save_on_background=False)
    _fit(fresh, distribution, epochs=3, callbacks=[checkpoint])
    straight = _model(keras.optimizers.Adam(0.01))
    _fit(straight, distribution, epochs=3)
    for a, b in zip(_state_slots(fresh), _state_slots(straight), strict=True):
        assert a.dtype == "bfloat16"
        np.testing.assert_allclose(
            np.asarray(a, "float32"), np.asarray(b, "float32"), rtol=0, atol=1e-6
        )


@jax_only
def test_an_optimizer_built_in_float32_is_refused_for_bfloat16_state():
    model = _model(keras.optimizers.Adam(0.01))
    _fit(model, kd.DataParallel())
    before = Untouched(model)
    distribution = kd.DataParallel(optimizer_state_dtype="bfloat16")
    with pytest.raises(ValueError, match="Compile the model again"):
        _fit(model, distribution)
    before.check()
    # Plain Keras and the corrected call (no state dtype) train it.
    model.fit(*_data(), batch_size=16, verbose=0)
    _fit(model, kd.DataParallel())


@jax_only
def test_bfloat16_slots_are_refused_by_a_distribution_without_the_state_dtype():
    model = _model(keras.optimizers.Adam(0.01))
    _fit(model, kd.DataParallel(optimizer_state_dtype="bfloat16"))
    before = Untouched(model)
    with pytest.raises(ValueError, match="narrower than its variable"):
        _fit(model, kd.DataParallel())
    before.check()
    _fit(model, kd.DataParallel(optimizer_state_dtype="bfloat16"))


@pytest.mark.backend("jax")
def test_the_static_plan_says_which_slots_live_in_host_memory_and_their_dtype():
    model = _model(keras.optimizers.Adam(0.01))
    plain = kd.plan(model, kd.FSDP(min_size=16))
    placed = kd.plan(
        model,
        kd.FSDP(min_size=16, offload="optimizer", optimizer_state_dtype="bfloat16"),
    )
    rows = {row.path: row for row in placed.rows if row.role == "optimizer"}
    moments = [row for path, row in rows.items() if path.endswith(STATE)]
    assert moments and {(r.memory, r.dtype) for r in moments} == {
        ("pinned_host", "bfloat16")
    }
    counter = next(row for path, row in rows.items() if path.endswith("/iteration"))
    assert counter.memory == "device"
    before, after = plain.devices[0], placed.devices[0]
    # The moments leave the device, at half their float32 size, for the host.
    assert after.host_optimizer_slots == sum(r.bytes_per_device for r in moments)
    assert after.host_optimizer_slots * 2 + after.optimizer_slots == pytest.approx(
        before.optimizer_slots, abs=16
    )
    assert after.total == before.total - before.optimizer_slots + after.optimizer_slots
    assert "slots in host memory" in str(placed)


@jax_only
def test_a_loss_scale_optimizer_offloads_its_inner_optimizers_slots():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        expected = _fit(_model(keras.optimizers.Adam(0.01)), kd.DataParallel())
        model = _model(keras.optimizers.Adam(0.01))
        weights = _fit(model, kd.DataParallel(offload="optimizer"))
    finally:
        keras.config.set_dtype_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert {v.value.sharding.memory_kind for v in _state_slots(model)} == {
        "pinned_host"
    }
