"""`kd.FSDP`: variables, gradients and optimizer slots split along the data axis.

JAX on 8 simulated devices here; PyTorch in `test_multiprocess_torch_fsdp.py`
(real processes, DTensor). TensorFlow refuses it (as it refuses every layout
that shards variables).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests import parity

BATCH = 20


def _fit(model, callbacks_factory):
    return parity.fit_evaluate_predict(model, callbacks_factory, batch=BATCH, epochs=2)


@pytest.fixture(scope="module")
def single_device_run():
    model = parity.sequential()
    return model, _fit(model, lambda: [])


def _bytes_on_device(variables, device) -> int:
    total = 0
    for variable in variables:
        for shard in variable.value.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


@pytest.mark.backend("jax")
def test_fsdp_matches_one_device_and_splits_parameters_and_slots(single_device_run):
    reference_model, reference = single_device_run
    distribution = kd.FSDP(min_size=0)
    assert distribution.device_mesh.shape == (8,)
    model = parity.sequential()
    result = _fit(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)

    hidden, head = model.get_layer("hidden"), model.get_layer("head")
    # The largest dimension that 8 divides carries the data axis.
    assert tuple(hidden.kernel.value.sharding.spec) == (None, "batch")
    assert {s.data.shape for s in hidden.kernel.value.addressable_shards} == {(6, 2)}
    assert tuple(head.kernel.value.sharding.spec) == ("batch", None)
    assert tuple(hidden.bias.value.sharding.spec) == ("batch",)
    # 3 divides into no 8 parts: replicated.
    assert head.bias.value.sharding.is_fully_replicated
    # Adam's two moments follow their variable.
    for variable in (hidden.kernel, head.kernel, hidden.bias):
        slots = [
            v
            for v in model.optimizer.variables
            if tuple(v.shape) == tuple(variable.shape) and "iteration" not in v.path
        ]
        assert len(slots) == 2, [v.path for v in slots]
        for slot in slots:
            assert slot.value.sharding.spec == variable.value.sharding.spec
    # Per device: 1/8 of every split variable and its slots.
    device = hidden.kernel.value.addressable_shards[0].device
    split = [hidden.kernel, head.kernel, hidden.bias]
    full = sum(int(np.prod(v.shape)) * 4 for v in split)
    assert _bytes_on_device(split, device) * 8 == full


@pytest.mark.backend("jax")
def test_fsdp_with_a_tensor_parallel_axis_matches_one_device(single_device_run):
    reference_model, reference = single_device_run
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden/bias"] = ("model",)
    distribution = kd.FSDP(layout_map=layout_map, min_size=0)
    model = parity.sequential()
    result = _fit(model, lambda: [kd.DistributeCallback(distribution)])
    parity.assert_same_training(reference, result, reference_model, model)
    hidden, head = model.get_layer("hidden"), model.get_layer("head")
    assert tuple(hidden.kernel.value.sharding.spec) == ("batch", "model")
    assert {s.data.shape for s in hidden.kernel.value.addressable_shards} == {(3, 4)}
    # The map's layout is kept; no dimension left for the data axis.
    assert tuple(hidden.bias.value.sharding.spec) == ("model",)
    assert tuple(head.kernel.value.sharding.spec) == ("batch", None)


def test_fsdp_layout_rule():
    mesh = kd.DeviceMesh((1,), ["batch"], kd.list_devices()[:1])
    one = kd.FSDP(mesh)
    assert one.batch_dim_name == "batch" and one.min_size == 1024
    # One device: nothing to split.
    assert one.fsdp_dimension("k", (64, 64), "float32", (None, None)) is None

    class Spec:
        def __init__(self, path, shape, dtype="float32"):
            self.path, self.shape, self.dtype = path, shape, dtype

    devices = [f"cpu:{i}" for i in range(4)]
    fsdp = kd.FSDP(kd.DeviceMesh((4,), ["data"], devices), axis="data", min_size=100)
    assert fsdp.layout_for_variable(Spec("a/kernel", (6, 40))).axes == (None, "data")
    assert fsdp.layout_for_variable(Spec("a/kernel", (40, 40))).axes == ("data", None)
    # Too small, integer, or no dimension that 4 divides: replicated.
    assert fsdp.layout_for_variable(Spec("a/bias", (40,))).axes == (None,)
    assert fsdp.layout_for_variable(Spec("seed", (400,), "uint32")).axes == (None,)
    assert fsdp.layout_for_variable(Spec("a/kernel", (15, 15))).axes == (None, None)


def test_fsdp_rejects_bad_arguments():
    mesh = kd.DeviceMesh((1,), ["batch"], kd.list_devices()[:1])
    with pytest.raises(ValueError, match="`axis` must be an axis of the mesh.*'data'"):
        kd.FSDP(mesh, axis="data")
    with pytest.raises(TypeError, match="min_size=True"):
        kd.FSDP(mesh, min_size=True)
    with pytest.raises(ValueError, match="min_size=-1"):
        kd.FSDP(mesh, min_size=-1)
    with pytest.raises(ValueError, match="not both"):
        kd.FSDP(mesh, devices=["cpu:0"])
    with pytest.raises(TypeError, match="keep_optimizer_sharded='yes'"):
        kd.FSDP(mesh, keep_optimizer_sharded="yes")
    assert isinstance(kd.FSDP(mesh), keras.distribution.ModelParallel)
    # The lean path is the default (issue 40), as FSDP2's and torchtitan's.
    assert kd.FSDP(mesh).keep_optimizer_sharded
    assert "keep_optimizer_sharded" not in repr(kd.FSDP(mesh))
    gathered = kd.FSDP(mesh, keep_optimizer_sharded=False)
    assert not gathered.keep_optimizer_sharded
    assert "keep_optimizer_sharded=False" in repr(gathered)


@pytest.mark.backend("tensorflow")
def test_tensorflow_refuses_fsdp_clearly():
    model = parity.sequential()
    x, y = parity.data()
    with pytest.raises(NotImplementedError, match="FSDP"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.FSDP(min_size=0))],
        )
    assert np.isfinite(model.evaluate(x, y, verbose=0)[0])


def _most_extra_on_one_device(build) -> tuple[int, int]:
    """While `build()` runs: the most bytes of live arrays one device held
    beyond the device holding least, over what that gap was before (read
    before and after every Keras variable assignment or initialization and
    every `jax.device_put`), and how many reads there were."""
    import jax

    from keras_dist.keras_compat.backend import variable_class

    def gap() -> int:
        held = dict.fromkeys(jax.devices(), 0)
        for array in jax.live_arrays():
            for shard in array.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return max(held.values()) - min(held.values())

    start = gap()
    most, reads = [0], [0]

    def look() -> None:
        reads[0] += 1
        most[0] = max(most[0], gap() - start)

    def around(function):
        def call(*args, **kwargs):
            look()
            result = function(*args, **kwargs)
            look()
            return result

        return call

    variable = variable_class("jax")
    originals = {
        name: getattr(variable, name)
        for name in ("_direct_assign", "_initialize_with_initializer")
    }
    device_put = jax.device_put
    try:
        for name, function in originals.items():
            setattr(variable, name, around(function))
        jax.device_put = around(device_put)
        build()
    finally:
        for name, function in originals.items():
            setattr(variable, name, function)
        jax.device_put = device_put
    return most[0], reads[0]


@pytest.mark.backend("jax")
def test_variables_made_under_fsdp_are_never_whole_on_one_device():
    def model():
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(256)]
        )

    kernel_bytes = 256 * 256 * 4
    distribution = kd.FSDP(min_size=0)
    with distribution.scope():
        ours, reads = _most_extra_on_one_device(model)
    # The control: Keras' own ModelParallel with the same layouts computes each
    # variable below 250 MiB whole on one device, then splits it.
    layout_map = keras.distribution.LayoutMap(distribution.device_mesh)
    layout_map["dense.*kernel"] = ("batch", None)
    layout_map["dense.*bias"] = ("batch",)
    keras_own = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with keras_own.scope():
        theirs, their_reads = _most_extra_on_one_device(model)
    assert reads > 0 and their_reads > 0
    assert theirs >= kernel_bytes // 2, theirs  # a whole kernel on one device
    assert ours < kernel_bytes // 8, ours  # at most a part, never a whole one


@pytest.mark.backend("jax")
def test_adam_slots_keras_builds_in_fit_are_split_as_each_is_made():
    # Built before the distribution: Keras' fit builds Adam before the run
    # starts; each slot is laid out as it is made, so the slots are never all
    # whole on one device together (Adam's whole state: 2 x the weights).
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(256)]
    )
    model.compile(optimizer="adam", loss="mse")
    build, seen = model.optimizer.build, []

    def measured_build(variables):
        seen.append(_most_extra_on_one_device(lambda: build(variables)))

    model.optimizer.build = measured_build
    x = np.zeros((8, 64), "float32")
    model.fit(
        x,
        np.zeros((8, 256), "float32"),
        batch_size=8,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.FSDP(min_size=0))],
    )
    adam_bytes = 2 * 4 * model.count_params()  # 657,408
    largest_slot = 256 * 256 * 4
    ((most, reads),) = seen
    assert reads > 0
    # One whole slot at a time, plus the parts: about 0.5 of Adam's whole
    # state here (1.0 when the slots were built whole and split at the start).
    assert most < largest_slot + adam_bytes // 4, (most, adam_bytes)
