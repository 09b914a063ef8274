"""Keras' own `keras.distribution` API, as Keras' own tests exercise it.

`distribute_tensor` with the backend's layout objects and with a symbolic
`KerasTensor`; layouts with fewer axes than the variable; `distribute_dataset`
called directly in a multi-process job; `initialize()` letting the backend's
own cluster detection run; empty axis names.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import cluster
from keras_dist.backends import get_adapter
from keras_dist.cluster import find_free_port
from keras_dist.common import job
from keras_dist.runtime import api as runtime
from tests.multiprocess import WORKERS, once_per_run, run_job, wait_then_clean_up
from tests.workers import keras_api_scenarios as scenarios

BACKEND = keras.backend.backend()
DEVICES = kd.list_devices()
COUNT = len(DEVICES)


@pytest.fixture(autouse=True)
def _no_cluster_environment(monkeypatch):
    """No cluster variable of the surrounding shell leaks into these tests."""
    for name in (
        runtime.JOB_ADDRESSES_VARIABLE,
        runtime.NUM_PROCESSES_VARIABLE,
        runtime.PROCESS_ID_VARIABLE,
        *cluster.ENVIRONMENT_VARIABLES,
    ):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR")):
            monkeypatch.delenv(name)


def _layout(axes) -> kd.TensorLayout:
    return kd.TensorLayout(axes, kd.DeviceMesh((COUNT,), ["batch"], DEVICES))


# -- distribute_tensor -----------------------------------------------------------------
def test_distribute_tensor_returns_a_keras_tensor_unchanged():
    symbolic = keras.Input((3,))
    layout = _layout(("batch", None))
    assert kd.distribute_tensor(symbolic, layout) is symbolic
    # Keras does the same, on every backend.
    assert keras.distribution.distribute_tensor(symbolic, layout) is symbolic
    # A layout without a mesh is fine for a symbolic tensor, as in Keras.
    assert kd.distribute_tensor(symbolic, kd.TensorLayout(("batch", None))) is symbolic


@pytest.mark.backend("jax")
def test_distribute_tensor_takes_jax_shardings_as_keras_does():
    import jax
    from jax.experimental import layout as jax_layout
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = kd.DeviceMesh((2, COUNT // 2), ["batch", "model"], DEVICES)
    sharding = NamedSharding(mesh.backend_mesh, PartitionSpec("batch", None))
    value = np.arange(COUNT * 4, dtype="float32").reshape(COUNT, 4)

    eager = kd.distribute_tensor(value, sharding)
    assert eager.sharding.is_equivalent_to(sharding, ndim=2)
    np.testing.assert_array_equal(np.asarray(eager), value)
    traced = jax.jit(lambda x: kd.distribute_tensor(x, sharding))(value)
    assert traced.sharding.is_equivalent_to(sharding, ndim=2)
    # JAX's sharding-and-memory-layout object, as Keras' own test passes it.
    formatted = kd.distribute_tensor(value, jax_layout.Format(sharding=sharding))
    assert formatted.sharding.is_equivalent_to(sharding, ndim=2)
    # The same as Keras' distribute_tensor on the same sharding.
    keras_result = keras.distribution.distribute_tensor(value, sharding)
    assert keras_result.sharding.is_equivalent_to(eager.sharding, ndim=2)


@pytest.mark.backend("torch")
def test_distribute_tensor_takes_dtensor_placements_for_a_dtensor():
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = kd.DeviceMesh((1,), ["batch"], DEVICES)
    layout = kd.TensorLayout(("batch", None), mesh)
    assert layout.backend_layout == (Shard(0),)
    dtensor = kd.distribute_tensor(torch.ones((4, 2)), layout)
    assert isinstance(dtensor, DTensor)
    assert tuple(dtensor.placements) == (Shard(0),)
    replicated = kd.distribute_tensor(dtensor, (Replicate(),))
    assert tuple(replicated.placements) == (Replicate(),)
    assert replicated.device_mesh is dtensor.device_mesh
    np.testing.assert_array_equal(replicated.full_tensor().numpy(), 1.0)
    # Placements have no mesh: a plain tensor needs a TensorLayout.
    with pytest.raises(ValueError, match="TensorLayout with a device mesh"):
        kd.distribute_tensor(torch.ones((4, 2)), [Replicate()])


@pytest.mark.parametrize("layout", ["batch", ("batch", None), object()])
def test_distribute_tensor_refuses_what_is_no_layout(layout):
    with pytest.raises(TypeError, match="backend_layout") as info:
        kd.distribute_tensor(np.zeros((2, 2)), layout)
    assert f"layout={layout!r}" in str(info.value)


# -- layouts with fewer axes than the variable -----------------------------------------
def _model_parallel(model_axis: int) -> kd.ModelParallel:
    mesh = kd.DeviceMesh((COUNT // model_axis, model_axis), ["batch", "model"], DEVICES)
    layout_map = kd.LayoutMap(mesh)
    for key, axes in scenarios.SHORT_LAYOUTS.items():
        layout_map[key] = axes
    layout_map["hidden/bias"] = ("model",)
    return kd.ModelParallel(layout_map=layout_map)


def test_a_short_layout_replicates_the_trailing_dimensions():
    model = scenarios.classifier()
    distribution = _model_parallel(1)
    hidden = model.get_layer("hidden")
    kernel = distribution.get_variable_layout(hidden.kernel)
    assert kernel.axes == ("model", None)
    assert kernel.device_mesh is distribution.device_mesh
    assert distribution.get_variable_layout(hidden.bias).axes == ("model",)
    # Keras' own ModelParallel accepts the same map (its JAX backend pads).
    keras_layout = keras.distribution.ModelParallel(
        layout_map=distribution.layout_map
    ).get_variable_layout(hidden.kernel)
    assert keras_layout.axes == ("model",)


def test_a_layout_with_more_axes_than_the_variable_is_refused():
    layout_map = _model_parallel(1).layout_map
    layout_map["middle/kernel"] = ("model", None, None)
    distribution = kd.ModelParallel(layout_map=layout_map)
    kernel = scenarios.classifier().get_layer("middle").kernel
    with pytest.raises(ValueError, match="middle/kernel'") as info:
        distribution.get_variable_layout(kernel)
    assert "shape (16, 4)" in str(info.value)
    assert "('model', None, None)" in str(info.value)


@pytest.mark.backend("jax")
def test_short_layouts_train_like_one_device_on_jax():
    reference = scenarios.fit_classifier(scenarios.classifier(), [])
    model = scenarios.classifier()
    distribution = _model_parallel(2)
    weights = scenarios.fit_classifier(model, [kd.DistributeCallback(distribution)])
    for ours, expected in zip(weights, reference, strict=True):
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    kernel = model.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == ("model", None)
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(3, 16)}
    # Adam's moments follow their kernel's (padded) layout.
    slots = [v for v in model.optimizer.variables if v.shape == (6, 16)]
    assert len(slots) == 2
    for slot in slots:
        assert tuple(slot.value.sharding.spec) == ("model", None)


_TWO_PROCESS_ENV = {
    "jax": {"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "1"},
    "torch": {"KERAS_BACKEND": "torch"},
    "tensorflow": {"KERAS_BACKEND": "tensorflow"},
}


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory) -> dict[str, list[dict]]:
    """This module's 2-process runs in one job (each start-up costs seconds:
    CI's time), each scenario's results by name."""
    names = ["distribute_dataset"] + (["short_layouts"] if BACKEND == "torch" else [])
    results = once_per_run(
        tmp_path_factory,
        "keras_api_job",
        lambda directory: run_job(
            "keras_api_worker.py",
            [",".join(names)],
            processes=2,
            env=_TWO_PROCESS_ENV[BACKEND],
            output_dir=directory,
        ),
    )
    if len(names) == 1:
        return {names[0]: results}
    return {name: [result[name] for result in results] for name in names}


@pytest.mark.backend("torch")
def test_short_layouts_train_like_one_device_on_torch_dtensor(two_process_job):
    reference = scenarios.fit_classifier(scenarios.classifier(), [])
    for result in two_process_job["short_layouts"]:
        for ours, expected in zip(result["weights"], reference, strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        # Each process held half the rows of the mapped kernels: replicated
        # along the batch axis, dimension 0 sharded along the model axis.
        assert result["held"]["hidden/kernel"] == [["R", "S(0)"], [3, 16]]
        assert result["held"]["head/kernel"] == [["R", "S(0)"], [2, 3]]
        assert result["held"]["middle/kernel"] == [["R", "R"], [16, 4]]


# -- distribute_dataset ----------------------------------------------------------------
@pytest.fixture
def two_processes(monkeypatch):
    """Policies built now see process 1 of a 2-process job."""
    monkeypatch.setattr(runtime, "num_processes", lambda: 2)
    monkeypatch.setattr(runtime, "process_id", lambda: 1)


@pytest.mark.backend("jax", "tensorflow")
def test_distribute_dataset_called_directly_shards_like_keras(two_processes):
    distribution = kd.DataParallel(devices=DEVICES)
    ours = list(distribution.distribute_dataset(scenarios.tf_dataset()))
    keras_policy = keras.distribution.DataParallel(devices=DEVICES)
    keras_policy._num_processes, keras_policy._process_id = 2, 1
    keras_policy._is_multi_process = True
    theirs = list(_keras_split(keras_policy, scenarios.tf_dataset()))
    assert len(ours) == len(theirs) == scenarios.ROWS // scenarios.BATCH
    for (x, y), (keras_x, keras_y) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(keras_x))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(keras_y))
    # Process 1 of 2 keeps the second half of every global batch of 8.
    x, _ = scenarios.regression_data()
    np.testing.assert_array_equal(np.asarray(ours[0][0]), x[4:8])


def _keras_split(policy, dataset):
    """Keras' own split of a tf.data dataset for `policy`: its
    `distribute_dataset` (3.15), or what its tf.data adapter does (3.16)."""
    if hasattr(policy, "distribute_dataset"):
        return policy.distribute_dataset(dataset)
    from keras.src.trainers.data_adapters import TFDatasetAdapter

    return TFDatasetAdapter(dataset, distribution=policy).get_tf_dataset()


def test_distribute_dataset_called_directly_refuses_what_keras_refuses(
    two_processes,
):
    distribution = kd.DataParallel(devices=DEVICES)
    with pytest.raises(ValueError, match="Received: ndarray"):
        distribution.distribute_dataset(np.zeros((8, 4)))
    # Not split by request, or for one process: unchanged.
    own_parts = kd.DataParallel(devices=DEVICES, auto_shard_dataset=False)
    dataset = [1, 2]
    assert own_parts.distribute_dataset(dataset) is dataset


def test_distribute_dataset_inside_keras_data_adapter_is_unchanged(two_processes):
    """Inside `fit` keras_dist splits batches itself: Keras' adapter must get
    the global dataset back (and accept every input type)."""
    from keras.src.trainers.data_adapters import get_data_adapter

    dataset = scenarios.tf_dataset()
    distribution = kd.DataParallel(devices=DEVICES)
    with distribution.scope():
        adapter = get_data_adapter(dataset)
        get_data_adapter(np.zeros((8, 4)), batch_size=4)
    assert adapter.get_tf_dataset() is dataset


def test_distribute_dataset_gives_each_process_its_part_in_a_real_job(
    two_process_job,
):
    results = two_process_job["distribute_dataset"]
    x, y = scenarios.regression_data()
    ids = x[:, 0].tolist()
    assert [result["processes"] for result in results] == [2, 2]
    first, second = (result["parts"] for result in results)
    for step, (mine, theirs) in enumerate(zip(first, second, strict=True)):
        batch = ids[step * scenarios.BATCH : (step + 1) * scenarios.BATCH]
        assert mine == batch[:4] and theirs == batch[4:]
    for result in results:
        assert "tf.data.Dataset" in result["refused"]
    # `fit` under `scope()` on the global dataset: split once, by keras_dist.
    reference = scenarios.regressor(trainer=False)
    import tensorflow as tf

    history = reference.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(scenarios.BATCH),
        epochs=2,
        verbose=0,
    ).history
    for result in results:
        for ours, expected in zip(
            result["weights"], reference.get_weights(), strict=True
        ):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(result["loss"], history["loss"], atol=1e-5)


# -- initialize ------------------------------------------------------------------------
@pytest.fixture
def asked(monkeypatch):
    """What `initialize` asks the adapter's cluster detection."""
    calls = []
    adapter = get_adapter()
    original = getattr(adapter, "join_detected_cluster", None)

    def spy(**kwargs):
        calls.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(adapter, "join_detected_cluster", spy, raising=False)
    return calls


def test_initialize_with_nothing_configured_asks_the_backend(asked):
    kd.initialize(timeout_seconds=7)
    assert asked == [{"timeout_seconds": 7}]
    # A plain machine: nothing detected, one process, as before.
    assert job.joined() == {}
    assert kd.num_processes() == 1


@pytest.mark.parametrize(
    "arguments",
    [{"num_processes": 1}, {"process_id": 0}, {"job_addresses": "127.0.0.1:1"}],
)
def test_initialize_configured_for_one_process_does_not_ask_the_backend(
    asked, arguments
):
    kd.initialize(**arguments)
    assert asked == []


def test_initialize_from_keras_variables_does_not_ask_the_backend(asked, monkeypatch):
    monkeypatch.setenv(runtime.NUM_PROCESSES_VARIABLE, "1")
    kd.initialize()
    assert asked == []


PLAIN_MACHINE = """
import time
start = time.monotonic()
import keras_dist as kd
kd.initialize()
import jax.numpy as jnp
print("alone", kd.num_processes(), float(jnp.ones(2).sum()),
      round(time.monotonic() - start, 1), flush=True)
"""


def _python_env(backend: str, **extra: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster.ENVIRONMENT_VARIABLES
        and not name.startswith(("SLURM_", "KERAS_DIST", "OMPI_", "JAX_COORDINATOR"))
    }
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", **extra)
    return env


@pytest.mark.backend("jax")
def test_initialize_on_a_plain_machine_lets_jax_detect_nothing_quickly():
    """Before any JAX computation JAX's own detection runs (and finds nothing):
    the process runs alone, without an error and without waiting."""
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_MACHINE],
        env=_python_env("jax"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words[:3] == ["alone", "1", "2.0"], result.stdout


@pytest.mark.backend("jax")
def test_jax_adapter_after_the_first_computation_finds_nothing_to_join():
    assert get_adapter().join_detected_cluster(timeout_seconds=1) is False


def _open_mpi_job(port: int, output_dir: pathlib.Path) -> list[dict]:
    """Two processes that only JAX's Open MPI detection can put in one job."""
    children = []
    for rank in range(2):
        env = _python_env(
            "jax",
            KERAS_DIST_CPU_DEVICES="1",
            OMPI_MCA_orte_hnp_uri="4096.0;tcp://127.0.0.1:1",
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            JAX_COORDINATOR_PORT=str(port),
            KERAS_DIST_INIT_TIMEOUT="60",
        )
        log = open(output_dir / f"log-{rank}.txt", "w")
        command = [
            sys.executable,
            str(WORKERS / "keras_api_worker.py"),
            "detected_cluster",
            str(output_dir / f"result-{rank}.json"),
        ]
        children.append(
            (subprocess.Popen(command, env=env, stdout=log, stderr=log), log)
        )
    wait_then_clean_up(children, 180)
    logs = [(output_dir / f"log-{rank}.txt").read_text()[-3000:] for rank in (0, 1)]
    assert [child.returncode for child, _ in children] == [0, 0], logs
    import json

    return [
        json.loads((output_dir / f"result-{rank}.json").read_text()) for rank in (0, 1)
    ]


@pytest.mark.backend("jax")
def test_initialize_joins_a_cluster_that_only_jax_detects(tmp_path):
    results = _open_mpi_job(find_free_port(), tmp_path)
    assert [r["processes"] for r in results] == [2, 2]
    assert [r["rank"] for r in results] == [0, 1]
    # One device per process, the same global list on both.
    assert len(results[0]["devices"]) == 2
    assert results[0]["devices"] == results[1]["devices"]
    assert [r["gathered_ranks"] for r in results] == [[0, 1]] * 2


# -- DeviceMesh axis names -------------------------------------------------------------
@pytest.mark.parametrize("axis_names", ["", [], ()])
def test_mesh_empty_axis_names_raise_value_error_like_keras(axis_names):
    with pytest.raises(ValueError, match="must not be empty") as info:
        kd.DeviceMesh((COUNT,), axis_names, DEVICES)
    assert f"axis_names={axis_names!r}" in str(info.value)
    # What Keras raises for the same arguments.
    with pytest.raises(ValueError):
        keras.distribution.DeviceMesh((COUNT,), axis_names, DEVICES)


def test_mesh_empty_axis_name_raises_value_error():
    with pytest.raises(ValueError, match="non-empty string") as info:
        kd.DeviceMesh((COUNT,), [""], DEVICES)
    assert "axis_names=['']" in str(info.value)


@pytest.mark.backend("torch")
def test_weights_without_a_gradient_train_as_in_plain_keras_on_one_torch_process():
    """A weight the loss never reaches (a second head the model does not call)
    gets no gradient; plain Keras trains the rest (its optimizer skips it). One
    process has no DDP, so keras_dist must not refuse it (issue 25, item 12)."""

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.used = keras.layers.Dense(1, name="used")
            self.unused = keras.layers.Dense(1, name="unused")

        def call(self, x):
            return self.used(x)

    def train(callbacks: list) -> list[np.ndarray]:
        keras.utils.set_random_seed(3)
        model = TwoHeads()
        model(np.zeros((1, 6), "float32"))
        model.unused(np.zeros((1, 6), "float32"))
        model.compile(optimizer="adam", loss="mse")
        x = np.random.default_rng(0).normal(size=(30, 6)).astype("float32")
        model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
        return model.get_weights()

    plain = train([])
    ours = train([kd.DistributeCallback(kd.DataParallel())])
    for got, expected in zip(ours, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
