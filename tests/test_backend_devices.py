"""Devices, processes and the not-yet-implemented paths of each backend adapter.

JAX and TensorFlow runs of the suite set `KERAS_DIST_CPU_DEVICES=8`; PyTorch
runs leave it unset and have one CPU device per process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.runtime import api as runtime

BACKEND = keras.backend.backend()
CPU_DEVICES = (
    1 if BACKEND == "torch" else int(os.environ.get("KERAS_DIST_CPU_DEVICES") or 1)
)
DEVICE_NAME = re.compile(r"^(cpu|gpu|tpu):\d+$")
NOT_YET = {
    "torch": "not implemented yet for the PyTorch backend",
    "tensorflow": "not implemented for the TensorFlow backend",
}.get(BACKEND, "")


@pytest.fixture
def no_cluster_env(monkeypatch):
    for name in (
        "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
        "KERAS_DISTRIBUTION_PROCESS_ID",
        "KERAS_DIST_INIT_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)


# -- devices and processes, every backend ------------------------------------------
def test_cpu_devices_are_named_cpu_n():
    assert kd.list_devices("cpu") == [f"cpu:{i}" for i in range(CPU_DEVICES)]
    assert kd.get_device_count("cpu") == CPU_DEVICES


def test_default_devices_are_device_names():
    devices = kd.list_devices()
    assert devices
    assert all(DEVICE_NAME.match(device) for device in devices), devices
    assert len(set(devices)) == len(devices)
    assert kd.get_device_count() == len(devices)
    assert runtime.get_device_count(None) == len(devices)


@pytest.mark.backend("jax", "tensorflow")
def test_simulated_cpu_devices_count():
    if not os.environ.get("KERAS_DIST_CPU_DEVICES"):
        pytest.skip("KERAS_DIST_CPU_DEVICES is not set")
    count = int(os.environ["KERAS_DIST_CPU_DEVICES"])
    assert kd.list_devices("cpu") == [f"cpu:{i}" for i in range(count)]


@pytest.mark.backend("torch")
def test_torch_has_one_cpu_device_per_process():
    assert kd.list_devices("cpu") == ["cpu:0"]
    assert get_adapter().local_device_count("cpu") == 1


def test_local_device_count_in_one_process():
    assert get_adapter().local_device_count("cpu") == CPU_DEVICES


def test_absent_device_type_lists_no_devices():
    assert kd.list_devices("tpu") == []
    assert kd.get_device_count("tpu") == 0


def test_one_process():
    assert kd.num_processes() == 1
    assert kd.process_id() == 0
    assert get_adapter().num_processes() == 1
    assert get_adapter().process_id() == 0


def test_adapter_serves_this_backend():
    assert get_adapter().name == BACKEND
    assert get_adapter() is get_adapter()


def test_initialize_without_arguments_is_a_no_op(monkeypatch, no_cluster_env):
    def fail(*args, **kwargs):
        raise AssertionError("a single process must not join a job")

    monkeypatch.setattr(get_adapter(), "initialize", fail)
    assert kd.initialize() is None
    assert job.joined() == {}
    assert kd.num_processes() == 1
    assert kd.process_id() == 0


@pytest.mark.backend("jax", "tensorflow")
def test_simulating_the_present_count_again_is_a_no_op():
    kd.list_devices("cpu")  # the runtime has started
    get_adapter().simulate_cpu_devices(CPU_DEVICES)
    assert kd.get_device_count("cpu") == CPU_DEVICES


@pytest.mark.backend("jax", "tensorflow")
def test_simulating_another_count_after_start_is_too_late():
    kd.list_devices("cpu")  # the runtime has started
    with pytest.raises(RuntimeError, match=f"={CPU_DEVICES + 1} came too late"):
        get_adapter().simulate_cpu_devices(CPU_DEVICES + 1)
    assert kd.get_device_count("cpu") == CPU_DEVICES


@pytest.mark.backend("torch")
def test_torch_cannot_simulate_cpu_devices():
    with pytest.raises(NotImplementedError, match="KERAS_DIST_CPU_DEVICES=2") as info:
        get_adapter().simulate_cpu_devices(2)
    assert "--nproc-per-node 2" in str(info.value)
    get_adapter().simulate_cpu_devices(1)  # one device per process is fine


@pytest.mark.backend("torch")
def test_torch_picks_nccl_on_gpus_and_refuses_more_processes_than_gpus(monkeypatch):
    import torch  # noqa: PLC0415

    from keras_dist.backends.torch import process_group  # noqa: PLC0415

    monkeypatch.delenv("KERAS_DIST_TORCH_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert process_group.backend_to_start() == "nccl"
    # Two processes on one GPU: NCCL would refuse them at the first
    # collective ("Duplicate GPU detected"); said before the job starts.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="share 1 GPU") as refused:
        process_group.backend_to_start()
    assert "KERAS_DIST_TORCH_BACKEND=gloo" in str(refused.value)
    assert "--nproc-per-node 1" in str(refused.value)
    # Asked for by name: what the user set.
    monkeypatch.setenv("KERAS_DIST_TORCH_BACKEND", "gloo")
    assert process_group.backend_to_start() == "gloo"


# -- what is refused is refused loudly, never trained on one device silently ---------
def tiny_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    return model


def tiny_data():
    x = np.ones((8, 3), dtype="float32")
    return x, 2 * np.ones((8, 1), dtype="float32")


class FunctionalNet(kd.Trainer, keras.Model):
    pass


@pytest.mark.backend("tensorflow")
def test_model_parallel_callback_refuses_to_run():
    mesh = kd.DeviceMesh((1, 1), ["batch", "model"], kd.list_devices()[:1])
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    callback = kd.DistributeCallback(kd.ModelParallel(layout_map=layout_map))
    with pytest.raises(
        NotImplementedError,
        match=rf"Sharding variables \(here 'dense.\*kernel' as \(None, 'model'\), "
        rf"through DTensor\) is {NOT_YET}",
    ):
        tiny_model().fit(*tiny_data(), batch_size=4, verbose=0, callbacks=[callback])
    assert kd.distribution() is None


@pytest.mark.backend("torch")
def test_torch_sharding_over_more_devices_than_processes_is_refused():
    mesh = kd.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    callback = kd.DistributeCallback(kd.ModelParallel(layout_map=layout_map))
    model = tiny_model()
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"shape \(1, 2\).*needs 2 processes.*has 1"):
        model.fit(*tiny_data(), batch_size=4, verbose=0, callbacks=[callback])
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)
    assert kd.distribution() is None


@pytest.mark.backend("torch")
def test_torch_layouts_become_dtensor_placements():
    from torch.distributed.tensor import Replicate, Shard

    from keras_dist.backends.torch.placements import placements

    names = ["batch", "model"]
    assert placements((None, "model"), names) == (Replicate(), Shard(1))
    assert placements(("model", None), names) == (Replicate(), Shard(0))
    assert placements(("model",), names) == (Replicate(), Shard(0))
    assert placements(("batch", None), names) == (Shard(0), Replicate())
    assert placements(("model", "batch"), names) == (Shard(1), Shard(0))
    assert placements((None, None), names) == (Replicate(), Replicate())
    assert placements((), names) == (Replicate(), Replicate())
    with pytest.raises(ValueError, match=r"\['data'\] are not axes of the mesh"):
        placements(("data", None), names)


@pytest.mark.backend("torch")
def test_torch_meshes_need_one_device_per_process():
    from keras_dist.backends.torch.placements import mesh_ranks

    mesh = kd.DeviceMesh((1, 2), ["batch", "model"], ["cpu:1", "cpu:0"])
    assert mesh_ranks(mesh, 2).tolist() == [[1, 0]]
    with pytest.raises(ValueError, match=r"shape \(1, 2\).*this job has 4"):
        mesh_ranks(mesh, 4)
    with pytest.raises(ValueError, match=r"device of every process once.*cpu:2"):
        mesh_ranks(kd.DeviceMesh((2,), ["model"], ["cpu:0", "cpu:2"]), 2)


@pytest.mark.backend("torch")
def test_torch_sharding_with_per_process_data_is_refused():
    from keras_dist.backends.torch.placements import check_batch_axis

    devices = [f"cpu:{i}" for i in range(4)]
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices)
    check_batch_axis(kd.ModelParallel(layout_map=kd.LayoutMap(mesh)))
    own_data = kd.ModelParallel(layout_map=kd.LayoutMap(mesh), auto_shard_dataset=False)
    with pytest.raises(ValueError, match="auto_shard_dataset=False.*'batch' of size 2"):
        check_batch_axis(own_data)


@pytest.mark.backend("torch")
def test_torch_data_parallel_over_more_devices_than_processes_is_refused():
    mesh = kd.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    callback = kd.DistributeCallback(kd.DataParallel(mesh))
    with pytest.raises(ValueError, match="needs that many processes"):
        tiny_model().fit(*tiny_data(), batch_size=4, verbose=0, callbacks=[callback])
    assert kd.distribution() is None


@pytest.mark.backend("torch")
@pytest.mark.parametrize("route", ["callback", "trainer"])
def test_torch_data_parallel_in_one_process_trains_like_keras(route):
    x = np.random.default_rng(0).normal(size=(21, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def build(distribution=None):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        if distribution is None:
            model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        else:
            model = FunctionalNet(
                inputs, keras.layers.Dense(1)(inputs), distribution=distribution
            )
        model.compile(loss="mse", optimizer="sgd", metrics=["mae"])
        return model

    reference = build()
    expected = reference.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    distribution = kd.DataParallel()
    if route == "trainer":
        model, callbacks = build(distribution), []
    else:
        model, callbacks = build(), [kd.DistributeCallback(distribution)]
    history = model.fit(
        x, y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=callbacks
    )
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, atol=1e-6)
    assert kd.distribution() is None
    assert "train_step" not in model.__dict__


@pytest.mark.backend("torch")
def test_torch_layouts_are_dtensor_placements_on_a_torch_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = kd.DeviceMesh((1, 1), ["batch", "model"], kd.list_devices()[:1])
    assert isinstance(mesh.backend_mesh, DeviceMesh)
    assert mesh.backend_mesh.mesh_dim_names == ("batch", "model")
    layout = kd.TensorLayout((None, "model"), mesh)
    assert layout.backend_layout == (Replicate(), Shard(1))
    value = np.arange(6, dtype="float32").reshape(2, 3)
    tensor = kd.distribute_tensor(value, layout)
    assert isinstance(tensor, DTensor) and tensor.placements == (Replicate(), Shard(1))
    np.testing.assert_array_equal(tensor.full_tensor().numpy(), value)
    moved = kd.distribute_tensor(tensor, kd.TensorLayout(("batch", None), mesh))
    assert moved.placements == (Shard(0), Replicate())


@pytest.mark.backend("tensorflow")
def test_backend_layouts_not_implemented():
    mesh = kd.DeviceMesh((1,), ["batch"], kd.list_devices()[:1])
    layout = kd.TensorLayout(("batch",), mesh)
    with pytest.raises(NotImplementedError, match=f"backend_layout is {NOT_YET}"):
        layout.backend_layout  # noqa: B018
    with pytest.raises(NotImplementedError, match=f"backend_mesh is {NOT_YET}"):
        mesh.backend_mesh  # noqa: B018
    with pytest.raises(NotImplementedError, match=f"distribute_tensor is {NOT_YET}"):
        kd.distribute_tensor(np.zeros((2,)), layout)


# -- jax: layouts are real shardings ------------------------------------------------
@pytest.mark.backend("jax")
def test_jax_layouts_are_named_shardings():
    import jax

    mesh = kd.DeviceMesh((2, CPU_DEVICES // 2), ["batch", "model"])
    layout = kd.TensorLayout(("batch", None), mesh)
    sharding = layout.backend_layout
    assert isinstance(sharding, jax.sharding.NamedSharding)
    assert sharding.mesh.axis_names == ("batch", "model")
    assert sharding.mesh.devices.shape == (2, CPU_DEVICES // 2)
    array = kd.distribute_tensor(np.zeros((4, 3), dtype="float32"), layout)
    assert array.sharding == sharding


@pytest.mark.backend("jax")
def test_jax_unknown_device_in_mesh():
    mesh = kd.DeviceMesh((1,), ["batch"], [f"cpu:{CPU_DEVICES + 90}"])
    with pytest.raises(ValueError, match=f"'cpu:{CPU_DEVICES + 90}'"):
        mesh.backend_mesh  # noqa: B018


# -- KERAS_DIST_CPU_DEVICES in a fresh process ---------------------------------------
def run_python(code: str, backend: str, devices: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND=backend, KERAS_DIST_CPU_DEVICES=devices, TF_CPP_MIN_LOG_LEVEL="3"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


IMPORT_ORDERS = {
    "keras_first": "import keras\nimport keras_dist as kd\n",
    "keras_dist_first": "import keras_dist as kd\nimport keras\n",
}
COUNT_DEVICES = (
    "print(kd.get_device_count('cpu'), len(keras.distribution.list_devices('cpu')))\n"
)


@pytest.mark.backend("jax")
@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_jax_simulated_devices_whatever_the_import_order(order):
    result = run_python(IMPORT_ORDERS[order] + COUNT_DEVICES, "jax", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4", "4"], result.stdout


@pytest.mark.backend("tensorflow")
@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_tensorflow_simulated_devices_whatever_the_import_order(order):
    code = IMPORT_ORDERS[order] + "print(kd.get_device_count('cpu'))\n"
    result = run_python(code, "tensorflow", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4"], result.stdout


@pytest.mark.backend("jax")
@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_jax_invalid_device_count_is_refused(order):
    result = run_python(IMPORT_ORDERS[order], "jax", "abc")
    assert result.returncode != 0
    assert "ValueError" in result.stderr
    assert "KERAS_DIST_CPU_DEVICES='abc'" in result.stderr


@pytest.mark.backend("jax")
def test_jax_device_count_after_jax_started_is_too_late():
    code = "import jax\njax.devices()\nimport keras_dist\n"
    result = run_python(code, "jax", "4")
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr
    assert "KERAS_DIST_CPU_DEVICES=4 came too late" in result.stderr
