"""Argument validation and `keras.distribution` interop of the public API.

One test per `raise` (and `warn`) branch of the backend-neutral core: each
checks the exception type and that the message names the value received. Most
tests are backend-neutral: meshes are built from `keras_dist.list_devices()`,
which is 8 simulated CPUs on JAX and TensorFlow and `cpu:0` on PyTorch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import cluster
from keras_dist.backends import get_adapter
from keras_dist.common import job, simulated_devices
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.runtime import api as runtime
from keras_dist.runtime import device_simulation
from keras_dist.training.session import DistributedRun

BACKEND = keras.backend.backend()
DEVICES = kd.list_devices()
COUNT = len(DEVICES)

CLUSTER_ENV_VARS = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
    "KERAS_DIST_INIT_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _clean_cluster_env(monkeypatch):
    """No cluster variable of the surrounding shell leaks into these tests."""
    for name in CLUSTER_ENV_VARS + cluster.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def escaped(text: str) -> str:
    return re.escape(text)


def mesh_1d(axis_name: str = "batch") -> kd.DeviceMesh:
    return kd.DeviceMesh((COUNT,), [axis_name], DEVICES)


def mesh_2d(axis_names=("batch", "model")) -> kd.DeviceMesh:
    return kd.DeviceMesh((1, COUNT), list(axis_names), DEVICES)


def built_dense(units: int = 2, input_dim: int = 3, name: str = "dense"):
    layer = keras.layers.Dense(units, name=name)
    layer.build((None, input_dim))
    return layer


# -- DeviceMesh ----------------------------------------------------------------
@pytest.mark.parametrize("shape", ["abc", None, [], (), {"a": 1}])
def test_mesh_shape_not_a_sequence(shape):
    with pytest.raises(TypeError, match=escaped(f"shape={shape!r}")):
        kd.DeviceMesh(shape, ["batch"], DEVICES[:1])


@pytest.mark.parametrize("shape", [(1.0,), (True,), ("1",)])
def test_mesh_shape_entries_not_ints(shape):
    with pytest.raises(TypeError, match=escaped(f"shape={shape!r}")):
        kd.DeviceMesh(shape, ["batch"], DEVICES[:1])


@pytest.mark.parametrize("shape", [(0,), (-1,), (1, 0)])
def test_mesh_shape_entries_below_one(shape):
    with pytest.raises(ValueError, match=escaped(f"shape={shape!r}")):
        kd.DeviceMesh(shape, ["batch", "model"][: len(shape)], DEVICES[:1])


@pytest.mark.parametrize("axis_names", ["batch", None, 3])
def test_mesh_axis_names_not_a_sequence(axis_names):
    with pytest.raises(TypeError, match=escaped(f"axis_names={axis_names!r}")):
        kd.DeviceMesh((1,), axis_names, DEVICES[:1])


def test_mesh_axis_names_wrong_length():
    with pytest.raises(ValueError, match=escaped("axis_names=['batch', 'model']")):
        kd.DeviceMesh((1,), ["batch", "model"], DEVICES[:1])


@pytest.mark.parametrize("axis_names", [[1], [None]])
def test_mesh_axis_names_not_strings(axis_names):
    with pytest.raises(TypeError, match=escaped(f"axis_names={axis_names!r}")):
        kd.DeviceMesh((1,), axis_names, DEVICES[:1])


def test_mesh_axis_names_duplicated():
    with pytest.raises(ValueError, match=escaped("axis_names=['batch', 'batch']")):
        kd.DeviceMesh((1, 1), ["batch", "batch"], DEVICES[:1])


def test_mesh_default_devices_do_not_fill_the_shape():
    with pytest.raises(ValueError, match=escaped(f"shape ({COUNT + 1},)")) as info:
        kd.DeviceMesh((COUNT + 1,), ["batch"])
    assert str(DEVICES) in str(info.value)


def test_mesh_devices_empty():
    with pytest.raises(ValueError, match=escaped("devices=[]")):
        kd.DeviceMesh((1,), ["batch"], [])


@pytest.mark.parametrize("device", ["cpu0", "CPU:0", "cpu:", "cpu:0 ", "/device:CPU:0"])
def test_mesh_device_name_malformed(device):
    with pytest.raises(ValueError, match=escaped(f"device={device!r}")):
        kd.DeviceMesh((1,), ["batch"], [device])


def test_mesh_devices_duplicated():
    with pytest.raises(ValueError, match=escaped("devices=['cpu:0', 'cpu:0']")):
        kd.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:0"])


def test_mesh_explicit_devices_do_not_fill_the_shape():
    with pytest.raises(ValueError, match=escaped(f"1 devices {DEVICES[:1]}")):
        kd.DeviceMesh((COUNT + 1,), ["batch"], DEVICES[:1])


def test_mesh_accepts_int_shape_default_devices_and_shaped_devices():
    mesh = kd.DeviceMesh(COUNT, ["batch"])
    assert mesh.shape == (COUNT,)
    assert mesh.axis_names == ["batch"]
    assert list(mesh.devices) == DEVICES
    shaped = kd.DeviceMesh((1, COUNT), ("batch", "model"), [DEVICES])
    assert shaped.devices.shape == (1, COUNT)
    assert shaped.devices.reshape(-1).tolist() == DEVICES


def test_mesh_equals_keras_mesh_with_same_devices():
    ours = mesh_2d()
    theirs = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"], DEVICES)
    assert ours == theirs
    assert ours == mesh_2d()
    assert ours != mesh_2d(("data", "model"))
    assert hash(ours) == hash(mesh_2d())


# -- TensorLayout ----------------------------------------------------------------
@pytest.mark.parametrize("axes", ["model", None, 3])
def test_layout_axes_not_a_sequence(axes):
    with pytest.raises(TypeError, match=escaped(f"axes={axes!r}")):
        kd.TensorLayout(axes)


@pytest.mark.parametrize("axes", [(1,), (None, 0.5)])
def test_layout_axes_entries_not_names(axes):
    with pytest.raises(TypeError, match=escaped(f"axes={axes!r}")):
        kd.TensorLayout(axes)


def test_layout_axis_used_twice():
    with pytest.raises(ValueError, match=escaped("axes=('model', 'model')")):
        kd.TensorLayout(("model", "model"))


def test_layout_device_mesh_of_wrong_type():
    with pytest.raises(TypeError, match=escaped("device_mesh='mesh' of type str")):
        kd.TensorLayout((None,), device_mesh="mesh")


def test_layout_axis_not_in_mesh():
    with pytest.raises(ValueError, match=escaped("'model' is not an axis")) as info:
        kd.TensorLayout((None, "model"), mesh_1d())
    assert "axes=(None, 'model')" in str(info.value)


def test_layout_mesh_cannot_be_replaced():
    layout = kd.TensorLayout((None,), mesh_1d())
    other = mesh_1d("data")
    with pytest.raises(ValueError, match=escaped(f"device_mesh={other}")):
        layout.device_mesh = other


def test_layout_same_mesh_may_be_set_again():
    mesh = mesh_1d()
    layout = kd.TensorLayout(("batch",), mesh)
    layout.device_mesh = mesh
    assert layout.device_mesh is mesh


def test_layout_backend_layout_without_mesh():
    with pytest.raises(ValueError, match=escaped("axes=(None, 'model')")):
        kd.TensorLayout((None, "model")).backend_layout  # noqa: B018


def test_layout_accepts_list_and_keras_mesh():
    keras_mesh = keras.distribution.DeviceMesh((COUNT,), ["batch"], DEVICES)
    layout = kd.TensorLayout(["batch", None], keras_mesh)
    assert layout.axes == ("batch", None)
    assert layout.device_mesh is keras_mesh


# -- LayoutMap -------------------------------------------------------------------
def test_layout_map_device_mesh_of_wrong_type():
    with pytest.raises(TypeError, match=escaped("device_mesh='mesh' of type str")):
        kd.LayoutMap("mesh")


def test_layout_map_lookup_key_not_a_string():
    layout_map = kd.LayoutMap(mesh_1d())
    with pytest.raises(TypeError, match=escaped("key=1")):
        layout_map[1]  # noqa: B018


def test_layout_map_set_key_not_a_string():
    layout_map = kd.LayoutMap(mesh_1d())
    with pytest.raises(TypeError, match=escaped("key=1")):
        layout_map[1] = (None,)


def test_layout_map_key_set_twice():
    layout_map = kd.LayoutMap(mesh_1d())
    layout_map["dense/kernel"] = (None, "batch")
    with pytest.raises(ValueError, match=escaped("'dense/kernel'")):
        layout_map["dense/kernel"] = (None, None)
    assert layout_map["dense/kernel"].axes == (None, "batch")


def test_layout_map_key_not_a_regex():
    layout_map = kd.LayoutMap(mesh_1d())
    with pytest.raises(ValueError, match=escaped("'dense['")):
        layout_map["dense["] = (None,)
    assert len(layout_map) == 0


@pytest.mark.parametrize("value", ["batch", 3, None])
def test_layout_map_value_of_wrong_type(value):
    layout_map = kd.LayoutMap(mesh_1d())
    with pytest.raises(TypeError, match=escaped(f"'dense' -> {value!r}")):
        layout_map["dense"] = value


def test_layout_map_value_axis_not_in_mesh():
    layout_map = kd.LayoutMap(mesh_1d())
    with pytest.raises(ValueError, match=escaped("'model' is not an axis")):
        layout_map["dense"] = (None, "model")


def test_layout_map_exact_key_wins_over_patterns():
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense.*"] = ("model", None)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["kernel"] = (None, None)
    assert layout_map["dense/kernel"].axes == (None, "model")


def test_layout_map_regex_search_anywhere_in_the_path():
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense.*kernel"] = (None, "model")
    layout_map["bias$"] = ("model",)
    assert layout_map["my_model/dense_1/kernel"].axes == (None, "model")
    assert layout_map["my_model/dense_1/bias"].axes == ("model",)
    assert layout_map.get("my_model/dense_1/bias") is layout_map["bias$"]


def test_layout_map_several_matches_name_the_keys():
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense"] = (None, "model")
    layout_map["kernel"] = ("model", None)
    with pytest.raises(ValueError, match=escaped("['dense', 'kernel']")) as info:
        layout_map["my_model/dense/kernel"]  # noqa: B018
    assert "'my_model/dense/kernel'" in str(info.value)


def test_layout_map_no_match_is_none():
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense.*kernel"] = (None, "model")
    assert layout_map["conv/kernel"] is None
    assert layout_map.get("dense/bias") is None
    assert kd.LayoutMap()["anything"] is None


def test_layout_map_tuples_become_layouts_on_the_map_mesh():
    mesh = mesh_2d()
    layout_map = kd.LayoutMap(mesh)
    layout_map["kernel"] = (None, "model")
    layout_map["bias"] = ["model"]
    layout_map["gamma"] = kd.TensorLayout(("model",))
    layout_map["beta"] = keras.distribution.TensorLayout(("model",))
    for key in ("kernel", "bias", "gamma", "beta"):
        layout = layout_map[key]
        assert isinstance(layout, keras.distribution.TensorLayout)
        assert layout.device_mesh is mesh
    assert isinstance(layout_map["kernel"], kd.TensorLayout)
    assert layout_map["bias"].axes == ("model",)
    assert layout_map.device_mesh is mesh


def test_layout_map_keeps_a_layout_own_mesh():
    other = mesh_2d()
    layout = kd.TensorLayout((None, "model"), other)
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["kernel"] = layout
    assert layout_map["kernel"].device_mesh is other


def test_layout_map_without_mesh_leaves_layouts_without_mesh():
    layout_map = kd.LayoutMap()
    layout_map["kernel"] = (None, "model")
    assert layout_map.device_mesh is None
    assert layout_map["kernel"].device_mesh is None


def test_layout_map_is_a_mutable_mapping():
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["a"] = (None,)
    layout_map["b"] = ("model",)
    assert list(layout_map) == ["a", "b"]
    assert len(layout_map) == 2
    del layout_map["a"]
    assert list(layout_map) == ["b"]
    layout_map["a"] = ("batch",)
    assert layout_map["a"].axes == ("batch",)


# -- isinstance interop ------------------------------------------------------------
def test_objects_are_keras_distribution_objects():
    mesh = mesh_2d()
    layout_map = kd.LayoutMap(mesh)
    layout_map["kernel"] = (None, "model")
    data_parallel = kd.DataParallel(devices=DEVICES)
    model_parallel = kd.ModelParallel(layout_map=layout_map)
    assert isinstance(mesh, keras.distribution.DeviceMesh)
    assert isinstance(kd.TensorLayout((None,)), keras.distribution.TensorLayout)
    assert isinstance(layout_map, keras.distribution.LayoutMap)
    assert isinstance(data_parallel, keras.distribution.DataParallel)
    assert isinstance(model_parallel, keras.distribution.ModelParallel)
    assert isinstance(data_parallel, KerasDistribution)
    assert isinstance(model_parallel, kd.Distribution)
    assert not isinstance(data_parallel, keras.distribution.ModelParallel)


# -- global distribution -------------------------------------------------------------
def test_set_distribution_is_what_keras_sees():
    distribution = kd.DataParallel(devices=DEVICES)
    kd.set_distribution(distribution)
    assert keras.distribution.distribution() is distribution
    assert kd.distribution() is distribution
    kd.set_distribution(None)
    assert keras.distribution.distribution() is None
    assert kd.distribution() is None


def test_distribution_set_through_keras_is_seen_by_keras_dist():
    distribution = kd.DataParallel(devices=DEVICES)
    keras.distribution.set_distribution(distribution)
    assert kd.distribution() is distribution


def test_set_distribution_accepts_keras_policies():
    keras_policy = keras.distribution.DataParallel(devices=DEVICES)
    kd.set_distribution(keras_policy)
    assert keras.distribution.distribution() is keras_policy


def test_scope_restores_the_previous_distribution():
    outer = kd.DataParallel(devices=DEVICES)
    inner = kd.ModelParallel(layout_map=kd.LayoutMap(mesh_2d()))
    kd.set_distribution(outer)
    with inner.scope():
        assert keras.distribution.distribution() is inner
        assert kd.distribution() is inner
    assert kd.distribution() is outer
    with pytest.raises(RuntimeError, match="boom"), inner.scope():
        raise RuntimeError("boom")
    assert kd.distribution() is outer
    kd.set_distribution(None)
    with outer.scope():
        assert kd.distribution() is outer
    assert kd.distribution() is None


@pytest.mark.parametrize("value", ["data_parallel", 3, object])
def test_set_distribution_of_wrong_type(value):
    with pytest.raises(TypeError, match=escaped(f"value={value!r}")):
        kd.set_distribution(value)
    assert kd.distribution() is None


def test_distribute_tensor_layout_of_wrong_type():
    with pytest.raises(TypeError, match=escaped("layout=(None,) of type tuple")):
        kd.distribute_tensor(np.zeros((2,)), (None,))


def test_distribute_tensor_layout_without_mesh():
    with pytest.raises(ValueError, match=escaped("axes=(None,)")):
        kd.distribute_tensor(np.zeros((2,)), kd.TensorLayout((None,)))


# -- Distribution, DataParallel ------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda mesh: kd.Distribution(mesh),
        lambda mesh: kd.DataParallel(device_mesh=mesh),
        lambda mesh: kd.ModelParallel(device_mesh=mesh, layout_map=kd.LayoutMap()),
    ],
    ids=["Distribution", "DataParallel", "ModelParallel"],
)
def test_policy_device_mesh_of_wrong_type(make):
    with pytest.raises(TypeError, match=escaped("device_mesh='mesh' of type str")):
        make("mesh")


def test_distribution_batch_dim_not_in_mesh():
    with pytest.raises(ValueError, match=escaped("batch_dim_name='data'")):
        kd.Distribution(mesh_2d(), batch_dim_name="data")


def test_model_parallel_batch_dim_not_in_mesh():
    layout_map = kd.LayoutMap(mesh_2d())
    with pytest.raises(ValueError, match=escaped("batch_dim_name='data'")):
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="data")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_auto_shard_dataset_not_a_bool(value):
    with pytest.raises(TypeError, match=escaped(f"auto_shard_dataset={value!r}")):
        kd.DataParallel(devices=DEVICES, auto_shard_dataset=value)


def test_data_layout_of_a_scalar():
    distribution = kd.DataParallel(devices=DEVICES)
    with pytest.raises(ValueError, match=escaped("data_shape=()")):
        distribution.get_data_layout(())


def test_distribution_defaults():
    distribution = kd.Distribution(mesh_2d())
    assert distribution.batch_dim_name == "batch"
    assert distribution.auto_shard_dataset is True
    assert distribution.num_model_replicas == 1
    layout = distribution.get_data_layout((4, 3, 2))
    assert layout.axes == ("batch", None, None)
    assert layout.device_mesh is distribution.device_mesh
    dataset = object()
    assert distribution.distribute_dataset(dataset) is dataset
    assert distribution.get_tensor_layout("dense/output") is None


def test_multi_process_policy_lets_keras_accept_every_input_type(monkeypatch):
    """keras_dist splits batches itself: Keras must not refuse numpy input
    for a multi-process keras_dist policy. Called directly, `distribute_dataset`
    refuses what Keras refuses (tests/test_keras_api_parity.py)."""
    monkeypatch.setattr(runtime, "num_processes", lambda: 2)
    distribution = kd.DataParallel(devices=DEVICES)
    assert distribution.num_processes == 2
    assert distribution._is_multi_process is False
    with pytest.raises(ValueError, match=escaped("Received: list")):
        distribution.distribute_dataset([1, 2])


def test_data_parallel_mesh_and_devices_both_given():
    with pytest.raises(ValueError, match=escaped(f"devices={DEVICES}")):
        kd.DataParallel(device_mesh=mesh_1d(), devices=DEVICES)


def test_data_parallel_devices_a_string():
    with pytest.raises(TypeError, match=escaped("devices='cpu:0'")):
        kd.DataParallel(devices="cpu:0")


def test_data_parallel_devices_not_iterable():
    with pytest.raises(TypeError, match=escaped("devices=5")):
        kd.DataParallel(devices=5)


def test_data_parallel_devices_empty():
    with pytest.raises(ValueError, match=escaped("devices=[]")):
        kd.DataParallel(devices=[])


def test_data_parallel_multi_axis_mesh_warns_once_on_process_zero(monkeypatch):
    monkeypatch.setattr(job, "_warned", set())
    mesh = mesh_2d()
    with pytest.warns(UserWarning, match=escaped(f"mesh of shape (1, {COUNT})")):
        distribution = kd.DataParallel(device_mesh=mesh)
    assert distribution.batch_dim_name == "batch"
    assert distribution.device_mesh is mesh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kd.DataParallel(device_mesh=mesh)  # the same warning again: silent


def test_warnings_stay_quiet_on_other_processes(monkeypatch):
    monkeypatch.setattr(job, "_warned", set())
    monkeypatch.setattr(job, "process_id", lambda: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.warn_once("only process 0 says this", UserWarning)


def test_data_parallel_sync_batch_norm_is_a_keyword_bool():
    assert kd.DataParallel().sync_batch_norm is True
    assert kd.DataParallel(sync_batch_norm=False).sync_batch_norm is False
    with pytest.raises(
        TypeError, match=r"sync_batch_norm` must be.*Received: sync_batch_norm='no'"
    ):
        kd.DataParallel(sync_batch_norm="no")
    with pytest.raises(TypeError):
        kd.DataParallel(None, None, True, False)  # keyword only


def test_data_parallel_defaults_and_one_axis_mesh_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_default = kd.DataParallel()
        by_devices = kd.DataParallel(devices=DEVICES)
        by_mesh = kd.DataParallel(device_mesh=mesh_1d("data"))
    assert list(by_default.device_mesh.devices) == DEVICES
    assert by_devices.device_mesh.axis_names == ["batch"]
    assert by_devices.num_model_replicas == COUNT
    assert by_mesh.batch_dim_name == "data"


# -- ModelParallel -----------------------------------------------------------------
def test_model_parallel_without_layout_map():
    with pytest.raises(ValueError, match=escaped("layout_map=")):
        kd.ModelParallel(device_mesh=mesh_2d())


@pytest.mark.parametrize("layout_map", [{"kernel": (None,)}, "kernel"])
def test_model_parallel_layout_map_of_wrong_type(layout_map):
    with pytest.raises(TypeError, match=escaped(f"layout_map={layout_map!r}")):
        kd.ModelParallel(device_mesh=mesh_2d(), layout_map=layout_map)


def test_model_parallel_without_any_mesh():
    with pytest.raises(ValueError, match="ModelParallel needs a mesh"):
        kd.ModelParallel(layout_map=kd.LayoutMap())


def test_model_parallel_mesh_differs_from_layout_map_mesh():
    mesh = mesh_2d()
    other = mesh_2d(("data", "model"))
    with pytest.raises(
        ValueError, match=escaped("layout_map.device_mesh=DeviceMesh(shape=(1,")
    ) as raised:
        kd.ModelParallel(device_mesh=mesh, layout_map=kd.LayoutMap(other))
    assert "axis_names=['data', 'model']" in str(raised.value)


def test_model_parallel_layout_axis_not_in_mesh():
    layout_map = kd.LayoutMap()
    layout_map["dense.*kernel"] = (None, "tensor")
    with pytest.raises(ValueError, match=escaped("'tensor' is not an axis")):
        kd.ModelParallel(device_mesh=mesh_2d(), layout_map=layout_map)


@pytest.mark.backend("jax", "tensorflow")
def test_model_parallel_processes_not_a_multiple_of_replicas(monkeypatch):
    monkeypatch.setattr(runtime, "num_processes", lambda: 3)
    mesh = kd.DeviceMesh((2, COUNT // 2), ["batch", "model"], DEVICES)
    with pytest.raises(
        ValueError, match=escaped("num_processes=3, num_model_replicas=2")
    ):
        kd.ModelParallel(layout_map=kd.LayoutMap(mesh))


@pytest.mark.backend("jax", "tensorflow")
def test_model_parallel_processes_a_multiple_of_replicas(monkeypatch):
    monkeypatch.setattr(runtime, "num_processes", lambda: 4)
    mesh = kd.DeviceMesh((2, COUNT // 2), ["batch", "model"], DEVICES)
    assert kd.ModelParallel(layout_map=kd.LayoutMap(mesh)).num_model_replicas == 2


def test_model_parallel_takes_the_layout_map_mesh():
    mesh = mesh_2d()
    layout_map = kd.LayoutMap(mesh)
    distribution = kd.ModelParallel(layout_map=layout_map)
    assert distribution.device_mesh is mesh
    assert distribution.layout_map is layout_map
    assert distribution.batch_dim_name == "batch"
    assert kd.ModelParallel(device_mesh=mesh, layout_map=layout_map).device_mesh is mesh


def test_model_parallel_accepts_an_equal_mesh():
    distribution = kd.ModelParallel(
        device_mesh=mesh_2d(), layout_map=kd.LayoutMap(mesh_2d())
    )
    assert distribution.device_mesh == mesh_2d()


def test_model_parallel_batch_dim_name():
    distribution = kd.ModelParallel(
        layout_map=kd.LayoutMap(mesh_2d()), batch_dim_name="model"
    )
    assert distribution.batch_dim_name == "model"
    assert distribution.num_model_replicas == COUNT
    assert distribution.get_data_layout((8, 2)).axes == ("model", None)


def test_model_parallel_variable_layouts():
    layer = built_dense()
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/.*output"] = ("batch", None)
    distribution = kd.ModelParallel(layout_map=layout_map)
    kernel = distribution.get_variable_layout(layer.kernel)
    assert kernel.axes == (None, "model")
    assert kernel.device_mesh is distribution.device_mesh
    bias = distribution.get_variable_layout(layer.bias)
    assert bias.axes == (None,)
    assert bias.device_mesh is distribution.device_mesh
    assert distribution.get_tensor_layout("dense/output").axes == ("batch", None)
    assert distribution.get_tensor_layout("conv/output") is None


def test_model_parallel_layouts_from_a_map_without_mesh_get_the_mesh():
    layer = built_dense()
    layout_map = kd.LayoutMap()
    layout_map["dense/kernel"] = (None, "model")
    mesh = mesh_2d()
    distribution = kd.ModelParallel(device_mesh=mesh, layout_map=layout_map)
    assert distribution.get_variable_layout(layer.kernel).device_mesh is mesh
    assert distribution.get_tensor_layout("dense/kernel").device_mesh is mesh


@pytest.mark.parametrize("axes", [(None, None, "model"), ("model", None, None)])
def test_model_parallel_layout_of_wrong_rank(axes):
    layer = built_dense()
    layout_map = kd.LayoutMap(mesh_2d())
    layout_map["dense/kernel"] = axes
    distribution = kd.ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match=escaped("'dense/kernel'")) as info:
        distribution.get_variable_layout(layer.kernel)
    assert "shape (3, 2)" in str(info.value)


def test_model_parallel_accepts_keras_layout_map_and_mesh():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"], DEVICES)
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map["dense/kernel"] = (None, "model")
    distribution = kd.ModelParallel(layout_map=keras_map)
    assert distribution.device_mesh is keras_mesh
    assert distribution.layout_map is keras_map
    layout = distribution.get_variable_layout(built_dense().kernel)
    assert layout.axes == (None, "model")
    assert layout.device_mesh is keras_mesh
    same = kd.ModelParallel(device_mesh=keras_mesh, layout_map=keras_map)
    assert same.device_mesh is keras_mesh


def test_model_parallel_keras_layout_map_keeps_its_lookup_rules():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"], DEVICES)
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map["dense.*kernel"] = (None, "model")
    ours = kd.LayoutMap(keras_mesh)
    ours["dense.*kernel"] = (None, "model")
    path = "my_model/dense/kernel"
    # Keras matches a whole path (re.fullmatch); keras_dist searches in it.
    assert kd.ModelParallel(layout_map=keras_map).get_tensor_layout(path) is None
    assert kd.ModelParallel(layout_map=ours).get_tensor_layout(path).axes == (
        None,
        "model",
    )
    assert kd.ModelParallel(layout_map=keras_map).get_tensor_layout("dense/kernel")


def test_model_parallel_keras_mesh_with_our_layout_map():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"], DEVICES)
    layout_map = kd.LayoutMap()
    layout_map["dense/kernel"] = (None, "model")
    distribution = kd.ModelParallel(device_mesh=keras_mesh, layout_map=layout_map)
    assert distribution.device_mesh is keras_mesh
    assert distribution.get_tensor_layout("dense/kernel").device_mesh is keras_mesh


def test_model_parallel_keras_mesh_differs_from_layout_map_mesh():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["data", "model"], DEVICES)
    with pytest.raises(ValueError, match=escaped("layout_map.device_mesh=")):
        kd.ModelParallel(device_mesh=keras_mesh, layout_map=kd.LayoutMap(mesh_2d()))


def test_model_parallel_keras_mesh_equal_to_layout_map_mesh():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"], DEVICES)
    distribution = kd.ModelParallel(
        device_mesh=keras_mesh, layout_map=kd.LayoutMap(mesh_2d())
    )
    assert distribution.device_mesh == mesh_2d()


@pytest.mark.backend("jax")
def test_model_parallel_keras_mesh_with_default_devices():
    keras_mesh = keras.distribution.DeviceMesh((1, COUNT), ["batch", "model"])
    keras_map = keras.distribution.LayoutMap(keras_mesh)
    keras_map["dense/kernel"] = (None, "model")
    distribution = kd.ModelParallel(layout_map=keras_map)
    assert distribution.device_mesh is keras_mesh
    assert distribution.get_tensor_layout("dense/kernel").axes == (None, "model")


# -- check_distribution (DistributeCallback, Trainer) --------------------------------
class FunctionalNet(kd.Trainer, keras.Model):
    pass


def functional_parts():
    inputs = keras.Input((3,))
    return inputs, keras.layers.Dense(1)(inputs)


@pytest.mark.parametrize("value", ["data_parallel", None, 3])
def test_callback_needs_a_keras_dist_distribution(value):
    with pytest.raises(TypeError, match=escaped(f"Received: {value!r} of type")):
        kd.DistributeCallback(value)


def test_callback_rejects_keras_policy_with_a_hint():
    keras_policy = keras.distribution.DataParallel(devices=DEVICES)
    with pytest.raises(TypeError, match="Keras' own policies") as info:
        kd.DistributeCallback(keras_policy)
    assert "of type DataParallel" in str(info.value)


def test_callback_accepts_keras_dist_policies():
    for distribution in (
        kd.DataParallel(devices=DEVICES),
        kd.ModelParallel(layout_map=kd.LayoutMap(mesh_2d())),
        kd.Distribution(mesh_1d()),
    ):
        assert kd.DistributeCallback(distribution).distribution is distribution


def test_trainer_needs_a_keras_dist_distribution():
    with pytest.raises(TypeError, match=escaped("Received: 'data_parallel'")) as info:
        FunctionalNet(*functional_parts(), distribution="data_parallel")
    assert "Trainer(distribution=...)" in str(info.value)


def test_trainer_rejects_keras_policy_with_a_hint():
    keras_policy = keras.distribution.DataParallel(devices=DEVICES)
    with pytest.raises(TypeError, match="Keras' own policies"):
        FunctionalNet(*functional_parts(), distribution=keras_policy)


def test_trainer_distribution_property():
    explicit = kd.DataParallel(devices=DEVICES)
    model = FunctionalNet(*functional_parts(), distribution=explicit)
    assert model.distribution is explicit
    plain = FunctionalNet(*functional_parts())
    assert plain.distribution is None
    global_one = kd.DataParallel(devices=DEVICES)
    with global_one.scope():
        assert plain.distribution is global_one
        assert model.distribution is explicit
    kd.set_distribution(keras.distribution.DataParallel(devices=DEVICES))
    assert plain.distribution is None


@pytest.mark.backend("jax")
def test_second_run_on_the_same_model_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    distribution = kd.DataParallel()
    run = DistributedRun(model, distribution).start()
    try:
        with pytest.raises(RuntimeError, match=escaped(f"model {model.name!r}")):
            DistributedRun(model, distribution).start()
        assert kd.distribution() is distribution
    finally:
        run.stop()
    assert kd.distribution() is None


# -- runtime: device types ----------------------------------------------------------
@pytest.mark.parametrize("device_type", ["xpu", "", 3])
def test_list_devices_unknown_device_type(device_type):
    with pytest.raises(ValueError, match=escaped(f"device_type={device_type!r}")):
        kd.list_devices(device_type)
    with pytest.raises(ValueError, match=escaped(f"device_type={device_type!r}")):
        kd.get_device_count(device_type)


def test_list_devices_device_type_is_case_insensitive():
    assert kd.list_devices("CPU") == kd.list_devices("cpu")


# -- runtime: resolve_cluster and initialize ------------------------------------
@pytest.mark.parametrize("name", ["num_processes", "process_id"])
@pytest.mark.parametrize("value", [True, "two", 1j, [1]])
def test_cluster_ints_of_wrong_type(name, value):
    with pytest.raises(TypeError, match=escaped(f"{name}={value!r}")):
        runtime.resolve_cluster(**{name: value})


@pytest.mark.parametrize("name", ["num_processes", "process_id"])
def test_cluster_ints_reject_fractions(name):
    with pytest.raises(TypeError, match=escaped(f"{name}=1.5")):
        runtime.resolve_cluster(**{name: 1.5})


@pytest.mark.parametrize(
    "variable", ["KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID"]
)
def test_cluster_env_ints_malformed(monkeypatch, variable):
    monkeypatch.setenv(variable, "two")
    with pytest.raises(ValueError, match=escaped(f"{variable}='two'")):
        runtime.resolve_cluster()


@pytest.mark.parametrize(
    "address", ["localhost", "localhost:0", "localhost:65536", ":1234", "host:port", ""]
)
def test_cluster_address_malformed(address):
    with pytest.raises(ValueError, match=escaped(f"Received: {address!r}")):
        runtime.resolve_cluster(job_addresses=address)


def test_cluster_one_malformed_address_among_several():
    with pytest.raises(ValueError, match=escaped("Received: 'b'")):
        runtime.resolve_cluster("a:1,b", num_processes=2, process_id=0)


def test_cluster_env_address_malformed(monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "nohost")
    with pytest.raises(ValueError, match=escaped("Received: 'nohost'")):
        runtime.resolve_cluster()


@pytest.mark.parametrize("value", [123, ["a:1", "b:2"]])
def test_cluster_job_addresses_not_a_string(value):
    with pytest.raises(TypeError, match=escaped(f"job_addresses={value!r}")):
        runtime.resolve_cluster(job_addresses=value)


@pytest.mark.parametrize("count", [0, -2])
def test_cluster_num_processes_below_one(count):
    with pytest.raises(ValueError, match=escaped(f"num_processes={count}")):
        runtime.resolve_cluster(num_processes=count)


def test_cluster_address_count_differs_from_num_processes():
    addresses = "a:1,b:2,c:3"
    with pytest.raises(ValueError, match=escaped(f"job_addresses={addresses!r}")):
        runtime.resolve_cluster(addresses, num_processes=2, process_id=0)


def test_cluster_multi_process_needs_process_id():
    with pytest.raises(ValueError, match="A job of 2 processes needs") as info:
        runtime.resolve_cluster("a:1", num_processes=2)
    assert "process_id" in str(info.value)


@pytest.mark.parametrize("rank", [2, -1])
def test_cluster_process_id_out_of_range(rank):
    with pytest.raises(ValueError, match=escaped(f"process_id={rank}, num_proc")):
        runtime.resolve_cluster("a:1", num_processes=2, process_id=rank)


def test_cluster_multi_process_needs_an_address():
    with pytest.raises(ValueError, match="A job of 2 processes needs the coord"):
        runtime.resolve_cluster(num_processes=2, process_id=1)


def test_cluster_defaults_to_one_process():
    assert runtime.resolve_cluster() == (None, 1, 0)
    assert runtime.resolve_cluster("host:1234") == ("host:1234", 1, 0)


def test_cluster_addresses_give_the_process_count():
    assert runtime.resolve_cluster("a:1, b:2,c:3", process_id=2) == ("a:1", 3, 2)
    assert runtime.resolve_cluster("[::1]:80", 4, 3) == ("[::1]:80", 4, 3)


def test_cluster_from_environment(monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "h1:1234,h2:1234")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    assert runtime.resolve_cluster() == ("h1:1234", 2, 1)
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "h1:1234")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "4")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "3")
    assert runtime.resolve_cluster() == ("h1:1234", 4, 3)


def test_cluster_empty_environment_values_are_unset(monkeypatch):
    for name in CLUSTER_ENV_VARS[:3]:
        monkeypatch.setenv(name, "")
    assert runtime.resolve_cluster() == (None, 1, 0)


def test_cluster_explicit_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "env1:1,env2:2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    assert runtime.resolve_cluster("arg:9", 1, 0) == ("arg:9", 1, 0)
    assert runtime.resolve_cluster(process_id=0) == ("env1:1", 2, 0)
    assert runtime.resolve_cluster("arg:9", 3, 2) == ("arg:9", 3, 2)


def test_cluster_explicit_arguments_skip_malformed_environment(monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "garbage")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "garbage")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "garbage")
    assert runtime.resolve_cluster("arg:9", 1, 0) == ("arg:9", 1, 0)


@pytest.fixture
def adapter_must_not_join(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"adapter.initialize was called: {args} {kwargs}")

    monkeypatch.setattr(get_adapter(), "initialize", fail)


def test_initialize_validates_the_cluster(adapter_must_not_join):
    with pytest.raises(ValueError, match=escaped("num_processes=0")):
        kd.initialize(num_processes=0)
    with pytest.raises(ValueError, match=escaped("Received: 'nohost'")):
        kd.initialize("nohost")


@pytest.mark.parametrize("timeout", [0, -1.5])
def test_initialize_timeout_not_positive(adapter_must_not_join, timeout):
    with pytest.raises(ValueError, match=escaped(f"Received: {timeout}")):
        kd.initialize(timeout_seconds=timeout)


def test_initialize_timeout_from_environment_not_positive(
    monkeypatch, adapter_must_not_join
):
    monkeypatch.setenv("KERAS_DIST_INIT_TIMEOUT", "0")
    with pytest.raises(
        ValueError, match=escaped("Received: KERAS_DIST_INIT_TIMEOUT='0'")
    ):
        kd.initialize()


def test_initialize_timeout_from_environment_malformed(
    monkeypatch, adapter_must_not_join
):
    monkeypatch.setenv("KERAS_DIST_INIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=escaped("KERAS_DIST_INIT_TIMEOUT='soon'")):
        kd.initialize()


def test_initialize_single_process_is_a_no_op(adapter_must_not_join):
    kd.initialize()
    kd.initialize("127.0.0.1:1234")
    kd.initialize(num_processes=1, process_id=0, timeout_seconds=1)
    assert job.joined() == {}
    assert kd.num_processes() == 1


def test_initialize_cannot_join_a_second_job(monkeypatch, adapter_must_not_join):
    joined = {"coordinator": "127.0.0.1:1111", "count": 2, "rank": 0}
    monkeypatch.setattr(job, "_joined", dict(joined))
    with pytest.raises(ValueError, match=escaped("coordinator=127.0.0.1:2222")):
        kd.initialize("127.0.0.1:2222", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=escaped("process_id=1")):
        kd.initialize("127.0.0.1:1111", num_processes=2, process_id=1)
    # Joining the same job again is a no-op.
    kd.initialize("127.0.0.1:1111", num_processes=2, process_id=0)
    assert job.joined() == joined


# -- KERAS_DIST_CPU_DEVICES ----------------------------------------------------------
@pytest.mark.parametrize("raw", ["abc", "0", "-1", "2.5", "8x", "00"])
def test_requested_cpu_devices_malformed(raw):
    environ = {"KERAS_DIST_CPU_DEVICES": raw}
    with pytest.raises(ValueError, match=escaped(f"KERAS_DIST_CPU_DEVICES={raw!r}")):
        device_simulation.requested_cpu_devices(environ)


def test_requested_cpu_devices_valid():
    requested = device_simulation.requested_cpu_devices
    assert requested({}) is None
    assert requested({"KERAS_DIST_CPU_DEVICES": ""}) is None
    assert requested({"KERAS_DIST_CPU_DEVICES": "  "}) is None
    assert requested({"KERAS_DIST_CPU_DEVICES": " 4 "}) == 4
    assert requested({"KERAS_DIST_CPU_DEVICES": "1"}) == 1


def test_requested_cpu_devices_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("KERAS_DIST_CPU_DEVICES", "bad")
    with pytest.raises(ValueError, match=escaped("KERAS_DIST_CPU_DEVICES='bad'")):
        device_simulation.requested_cpu_devices()
    monkeypatch.setenv("KERAS_DIST_CPU_DEVICES", "3")
    assert device_simulation.requested_cpu_devices() == 3


# -- KERAS_DIST_CPU_DEVICES after the backend started (issue 25, item 8) -----------
# What starts each backend's runtime, in a fresh process.
FIRST_WORK = {
    "jax": "import jax\njax.numpy.ones(2).sum()\n",
    "tensorflow": "import tensorflow as tf\ntf.constant([1.0, 2.0]) * 2\n",
}


def _run_fresh(code: str, environment: dict[str, str]) -> str:
    """`code` in a fresh Python: its stderr (it must fail)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "KERAS_DIST_CPU_DEVICES"
    }
    env.update(KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3", **environment)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    return " ".join(done.stderr.split())  # one line: the message wraps nowhere


@pytest.mark.backend("jax", "tensorflow")
def test_devices_set_after_the_first_computation_name_that_as_the_cause():
    code = (
        FIRST_WORK[BACKEND]
        + "import os\nos.environ['KERAS_DIST_CPU_DEVICES'] = '4'\nimport keras_dist\n"
    )
    message = _run_fresh(code, {})
    backend = {"jax": "JAX", "tensorflow": "TensorFlow"}[BACKEND]
    work = {"jax": "JAX computation", "tensorflow": "TensorFlow operation"}[BACKEND]
    assert (
        f"RuntimeError: KERAS_DIST_CPU_DEVICES=4 came too late: {backend} had "
        "already started, with 1 CPU device(s), when keras_dist applied it. The "
        "variable was set while the program ran (this process started without it)"
    ) in message
    assert f"Set it, and import keras_dist, before the first {work}" in message


@pytest.mark.backend("jax", "tensorflow")
def test_devices_set_at_start_but_imported_late_name_the_import_as_the_cause():
    message = _run_fresh(
        FIRST_WORK[BACKEND] + "import keras_dist\n", {"KERAS_DIST_CPU_DEVICES": "4"}
    )
    work = {"jax": "JAX computation", "tensorflow": "TensorFlow operation"}[BACKEND]
    assert "KERAS_DIST_CPU_DEVICES=4 came too late" in message
    assert (
        "The variable was set when this process started, but keras_dist applies "
        f"it when it is imported, and it was imported after the first {work}. "
        f"Import keras_dist before the first {work}"
    ) in message
    # Not the old advice, wrong here: the variable was set before anything ran.
    assert "Set the variable before" not in message


def test_where_the_initial_environment_cannot_be_read_both_fixes_are_named(tmp_path):
    initial = tmp_path / "environ"
    initial.write_bytes(b"HOME=/root\0KERAS_DIST_CPU_DEVICES= 04 \0")
    assert simulated_devices.set_when_the_process_started(4, path=str(initial))
    assert not simulated_devices.set_when_the_process_started(8, path=str(initial))
    initial.write_bytes(b"HOME=/root\0")
    assert simulated_devices.set_when_the_process_started(4, path=str(initial)) is False
    missing = str(tmp_path / "missing")
    assert simulated_devices.set_when_the_process_started(4, path=missing) is None
    message = simulated_devices.too_late_message(
        backend="JAX",
        requested=4,
        present=1,
        first_work="JAX computation",
        examples="jax.numpy",
        set_at_start=None,
    )
    assert message == (
        "KERAS_DIST_CPU_DEVICES=4 came too late: JAX had already started, with 1 "
        "CPU device(s), when keras_dist applied it (at import keras_dist). Set the "
        "variable, and import keras_dist, before the first JAX computation "
        "(jax.numpy)."
    )


@pytest.mark.backend("jax")
def test_a_jax_refusal_that_is_not_a_started_runtime_says_what_jax_said(monkeypatch):
    import jax  # noqa: PLC0415
    from jax._src import xla_bridge  # noqa: PLC0415

    def refuse(name, value):
        raise RuntimeError("no such CPU client")

    monkeypatch.setattr(jax.config, "update", refuse)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="no such CPU client") as info:
        get_adapter().simulate_cpu_devices(4)
    assert "could not simulate 4 CPU devices" in str(info.value)
    assert "too late" not in str(info.value)


@pytest.mark.backend("tensorflow")
def test_a_tensorflow_refusal_that_is_not_a_started_runtime_says_what_tf_said(
    monkeypatch,
):
    import tensorflow as tf  # noqa: PLC0415

    def refuse(device, configuration):
        raise RuntimeError("no logical devices here")

    monkeypatch.setattr(tf.config, "set_logical_device_configuration", refuse)
    with pytest.raises(RuntimeError, match="no logical devices here") as info:
        get_adapter().simulate_cpu_devices(4)
    assert "could not simulate 4 CPU devices" in str(info.value)
    assert "too late" not in str(info.value)


@pytest.mark.backend("torch")
def test_an_unknown_torch_gradient_sync_fails_when_fit_starts(monkeypatch):
    monkeypatch.setenv("KERAS_DIST_TORCH_GRADIENT_SYNC", "bucketed")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="KERAS_DIST_TORCH_GRADIENT_SYNC") as info:
        model.fit(
            np.ones((4, 3), "float32"),
            np.zeros((4, 2), "float32"),
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    assert "'bucketed'" in str(info.value)
    assert "ddp, after_backward" in str(info.value)
    assert kd.distribution() is None
    assert model.optimizer.iterations.numpy() == 0
