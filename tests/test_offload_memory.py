"""`offload="optimizer"` never holds an optimizer slot in device memory: its
slots are made in host memory (not made on the device and moved), restored
straight into it, and saved from it; `optimizer_state_dtype=` slots are made
in their dtype. Every `jax.device_put` is recorded (what Keras' and Orbax'
placements go through) and the live arrays are read at each moment."""

from __future__ import annotations

import gc

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd

pytestmark = pytest.mark.backend("jax")

STATE = ("momentum", "velocity")
SHAPES = ((12, 24), (24, 8))  # the kernels: each slot of a kernel has its shape


def _model() -> keras.Model:
    gc.collect()  # the arrays of earlier tests' models gone
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(24, name="first"),
            keras.layers.Dense(8, name="second"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _fit(model: keras.Model, distribution: object, *callbacks: object) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 12)).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution), *callbacks],
    )


class _Puts:
    """Every `jax.device_put` while recording: its value's memory kind
    (`"numpy"` for a host array), its destination's and its shape."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str, tuple]] = []
        original = jax.device_put

        def device_put(x: object, device: object = None, *args, **kwargs):
            self.calls.append(
                (
                    _memory_kind(x),
                    _memory_kind(device) if device is not None else "device",
                    tuple(getattr(x, "shape", ())),
                )
            )
            return original(x, device, *args, **kwargs)

        monkeypatch.setattr(jax, "device_put", device_put)

    def kernel_sized(self, source: str, destination: str) -> int:
        return sum(
            1
            for calls in self.calls
            if calls[:2] == (source, destination) and calls[2] in SHAPES
        )


def _memory_kind(x: object) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    sharding = getattr(x, "sharding", x)
    sharding = getattr(sharding, "sharding", sharding)  # a Format's
    return str(getattr(sharding, "memory_kind", None) or "device")


def _device_kernels() -> list:
    """Live arrays of a kernel's shape (a weight's or a slot's) in device
    memory."""
    gc.collect()
    return [
        array
        for array in jax.live_arrays()
        if tuple(array.shape) in SHAPES and array.sharding.memory_kind == "device"
    ]


def _new(arrays: list, before: list, model: keras.Model) -> list:
    """`arrays` that were not there `before` and are not `model`'s weights."""
    old = {id(array) for array in before} | {id(v.value) for v in model.weights}
    return [array for array in arrays if id(array) not in old]


def _slots(model: keras.Model) -> list:
    return [v for v in model.optimizer.variables if v.name.endswith(STATE)]


class _AtTheStart(keras.callbacks.Callback):
    """At fit's start (the optimizer just built): the slots' memory kinds
    and dtypes, and the kernel-shaped arrays on the devices other than the
    weights and those there before."""

    def __init__(self, before: list) -> None:
        super().__init__()
        self.before = before

    def on_train_begin(self, logs: object = None) -> None:
        slots = _slots(self.model)
        self.kinds = {v.value.sharding.memory_kind for v in slots}
        self.dtypes = {str(v.value.dtype) for v in slots}
        self.slot_values = {id(v.value) for v in slots if tuple(v.shape) in SHAPES}
        self.new_on_device = _new(_device_kernels(), self.before, self.model)


@pytest.mark.parametrize(
    ("kind", "state_dtype"),
    [("dp", None), ("fsdp", "bfloat16")],
)
def test_offloaded_slots_are_made_in_host_memory_never_moved_there(
    kind, state_dtype, monkeypatch
):
    placement = {"offload": "optimizer", "optimizer_state_dtype": state_dtype}
    distribution = (
        kd.DataParallel(**placement)
        if kind == "dp"
        else kd.FSDP(min_size=16, **placement)
    )
    before = _device_kernels()
    model = _model()
    puts = _Puts(monkeypatch)
    start = _AtTheStart(before)
    _fit(model, distribution, start)
    assert start.kinds == {"pinned_host"}
    assert start.dtypes == {state_dtype or "float32"}
    # Made on the device and moved, each kernel's two slots would go from
    # device memory to host memory: none did, and at fit's start the
    # devices hold no kernel-shaped array but the weights.
    assert puts.kernel_sized("device", "pinned_host") == 0
    assert start.new_on_device == []


def test_a_restore_under_offload_loads_the_slots_straight_into_host_memory(
    tmp_path, monkeypatch
):
    from keras_dist.backends.jax import checkpoint as jax_checkpoint

    distribution = kd.DataParallel(offload="optimizer")
    model = _model()
    checkpoint = kd.Checkpoint(tmp_path, save_freq="epoch", save_on_background=False)
    puts = _Puts(monkeypatch)
    _fit(model, distribution, checkpoint)
    # The save copied nothing into device memory (slots read from the host).
    assert puts.kernel_sized("pinned_host", "device") == 0
    del model
    before = _device_kernels()
    fresh = _model()
    puts.calls.clear()
    seen = []
    original = jax_checkpoint._restore

    def restore(*args, **kwargs):
        restored = original(*args, **kwargs)
        seen.append(len(_new(_device_kernels(), before, fresh)))
        return restored

    monkeypatch.setattr(jax_checkpoint, "_restore", restore)
    with distribution.scope():
        assert kd.restore(fresh, str(tmp_path)) == 2
    assert {v.value.sharding.memory_kind for v in _slots(fresh)} == {"pinned_host"}
    # The optimizer was built for the restore with its slots in host memory,
    # and the saved slots went from the file straight there: the devices
    # hold no kernel-shaped array but the weights.
    assert puts.kernel_sized("device", "pinned_host") == 0
    assert puts.kernel_sized("numpy", "pinned_host") > 0
    assert _new(_device_kernels(), before, fresh) == []
    # Each restored kernel stood beside the one it replaces alone (all at
    # once: both kernels twice over); the slots came in a group of their own.
    assert len(seen) > 2
    assert max(seen) == 1
    trained = [np.asarray(v) for v in _slots(fresh)]
    assert all(np.any(value != 0) for value in trained)


def test_without_offload_the_slots_are_made_on_the_devices():
    before = _device_kernels()
    model = _model()
    start = _AtTheStart(before)
    _fit(model, kd.FSDP(min_size=16), start)
    assert start.kinds == {"device"}
    # What the checks above see: here each kernel's two slots.
    assert {id(array) for array in start.new_on_device} == start.slot_values


def test_a_slot_of_any_initializer_is_made_in_host_memory():
    from keras_dist.backends.jax import host_state

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    host = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host"
    )
    for initializer, expected in (
        (keras.initializers.Constant(0.5), 0.5),
        (keras.initializers.Ones(), 1.0),
        (keras.initializers.RandomUniform(2.0, 3.0), None),
    ):
        value = host_state.made_in_host_memory(initializer, (4, 3), "bfloat16", host)
        assert value.sharding.memory_kind == "pinned_host"
        assert value.dtype == "bfloat16" and value.shape == (4, 3)
        array = np.asarray(value, "float32")
        if expected is None:
            assert 2.0 <= array.min() and array.max() <= 3.0
        else:
            np.testing.assert_array_equal(array, np.full((4, 3), expected))
    on_device = host.with_memory_kind("device")
    assert (
        host_state.made_in_host_memory(
            keras.initializers.Zeros(), (4,), "float32", on_device
        )
        is None
    )
