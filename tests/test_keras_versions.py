"""keras_dist on every Keras release it supports (3.15 and 3.16): nothing is
done twice by Keras and keras_dist.

Keras 3.16 distributes by itself where 3.15 did not: its torch trainer wraps
the model in its own DistributedDataParallel and sums the metric states over
the processes, its data adapters shard every input per process, its JAX steps
read one item per execution. keras_dist does each of these once, itself; the
jobs here count that it happened once (and would count two if Keras did it
too), and compare with plain Keras on one device of the installed release.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.keras_compat import data_adapters, epoch_iterator, versions
from keras_dist.runtime import api as runtime
from tests.conftest import BACKEND
from tests.multiprocess import once_per_run, run_job
from tests.workers import keras_versions_scenarios as scenarios

NEWER = versions.keras_version() >= (3, 16)


# -- what keras_compat finds on this release ------------------------------------
def test_what_keras_distributes_itself_is_detected_on_this_release():
    """Detected by feature, never by version; checked here against the
    version, so that a detection that stops finding a 3.16 feature (and lets
    Keras do it a second time) fails."""
    assert data_adapters.shards_inside_adapters() is NEWER
    assert data_adapters.shuffles_from_adapter_epoch() is NEWER
    assert epoch_iterator.reads_one_item_per_execution() is NEWER
    if BACKEND == "torch":
        from keras_dist.keras_compat import torch_trainer

        assert torch_trainer.keras_wraps_in_ddp() is NEWER
        assert torch_trainer.keras_sums_metrics() is NEWER
        assert torch_trainer.creates_dtensors_at_init() is NEWER
        assert torch_trainer.keras_promotes_dtensors() is NEWER


@pytest.fixture
def process_one_of_two(monkeypatch):
    """Policies built now see process 0 of a 2-process job of 2 replicas."""
    monkeypatch.setattr(runtime, "num_processes", lambda: 2)
    monkeypatch.setattr(runtime, "process_id", lambda: 0)
    monkeypatch.setattr(kd.DataParallel, "num_model_replicas", property(lambda _: 2))


def _batches_of(adapter) -> int:
    return sum(1 for _ in adapter.get_numpy_iterator())


def _keras_policy_of_two_processes():
    """Keras' own DataParallel of 2 replicas, as process 0 of 2 sees it
    (built without Keras' `__init__`, which would list this job's devices)."""

    class TwoReplicas(keras.distribution.DataParallel):
        num_model_replicas = 2

    policy = object.__new__(TwoReplicas)
    policy._device_mesh = kd.DataParallel().device_mesh
    policy._batch_dim_name = policy._device_mesh.axis_names[0]
    policy._auto_shard_dataset = True
    policy._num_processes, policy._process_id = 2, 0
    policy._is_multi_process = False  # Keras 3.15 would refuse arrays
    return policy


def test_keras_data_adapters_leave_keras_dist_data_whole(process_one_of_two):
    """4 batches of 2 rows built under a keras_dist policy of 2 processes:
    Keras' adapters hand all 4 on (keras_dist splits each batch itself);
    under Keras' own policy with the same facts, Keras 3.16 shards them."""
    from keras.src.backend.common import global_state
    from keras.src.trainers.data_adapters import get_data_adapter

    x = np.arange(8, dtype="float32")[:, None]
    distribution = kd.DataParallel()
    assert distribution.num_model_replicas == 2 and distribution.auto_shard_dataset
    with distribution.scope():
        adapters = [
            get_data_adapter(x, batch_size=2),
            get_data_adapter(_py_dataset(x)),
        ]
    assert [_batches_of(adapter) for adapter in adapters] == [4, 4]
    keras_policy = _keras_policy_of_two_processes()
    global_state.set_global_attribute("distribution", keras_policy)
    try:
        keras_adapter = get_data_adapter(x, batch_size=2)
    finally:
        global_state.set_global_attribute("distribution", None)
    assert _batches_of(keras_adapter) == (2 if NEWER else 4)


def _py_dataset(x):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[2 * index : 2 * index + 2]

    return Batches()


def test_auto_shard_dataset_is_still_the_users_outside_keras_adapters():
    distribution = kd.DataParallel(auto_shard_dataset=True)
    distribution.auto_shard_dataset = False
    assert distribution.auto_shard_dataset is False
    with pytest.raises(TypeError, match=r"Received: auto_shard_dataset='no'"):
        distribution.auto_shard_dataset = "no"


# -- distribute_dataset, called directly: keras_dist's own rebatch and shard -------
def test_distribute_dataset_refuses_a_dataset_it_cannot_split(process_one_of_two):
    import tensorflow as tf

    distribution = kd.DataParallel()
    rows = tf.data.Dataset.from_tensor_slices(np.arange(8.0))
    with pytest.raises(ValueError, match=r"known batch size.*Received: element_spec"):
        distribution.distribute_dataset(rows)  # scalars: not batched
    with pytest.raises(ValueError, match=r"Received: batch size 3"):
        distribution.distribute_dataset(rows.batch(3))
    unknown = tf.data.Dataset.from_generator(
        lambda: iter([np.zeros(4, "float32")]),
        output_signature=tf.TensorSpec((None,), tf.float32),
    )
    with pytest.raises(ValueError, match=r"batch size is unknown"):
        distribution.distribute_dataset(unknown)
    halves = [
        np.asarray(b).tolist()
        for b in distribution.distribute_dataset(
            tf.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4)
        )
    ]
    assert halves == [[0.0, 1.0], [4.0, 5.0]]


# -- Keras' layer-output relayout goes through a proxy ------------------------------
def test_output_layouts_are_routed_and_the_rest_reaches_keras():
    from keras.src.distribution import distribution_lib

    from keras_dist.keras_compat.distribution import route_output_layouts

    real = distribution_lib.distribution_lib

    def distribute(tensor, layout):
        return tensor

    undo = route_output_layouts(distribute)
    try:
        proxy = distribution_lib.distribution_lib
        assert proxy.distribute_tensor is distribute
        if real is None:  # Keras 3.15 on PyTorch has no backend module
            with pytest.raises(
                AttributeError, match="Received: a read of 'list_devices'"
            ):
                proxy.list_devices  # noqa: B018
        else:
            assert proxy.list_devices is real.list_devices
    finally:
        undo()
    assert distribution_lib.distribution_lib is real


@pytest.mark.backend("torch")
def test_keras_dtensor_promotion_is_left_and_entered_again():
    from keras_dist.keras_compat import torch_trainer

    mesh = kd.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    with kd.ModelParallel(layout_map=layout_map).scope():
        assert torch_trainer.dtensor_promotion_active() is NEWER
        undo = torch_trainer.leave_dtensor_promotion()
        assert not torch_trainer.dtensor_promotion_active()
        undo()
        assert torch_trainer.dtensor_promotion_active() is NEWER
    assert not torch_trainer.dtensor_promotion_active()


# -- the jobs: each process counted -------------------------------------------------
_ENV = {
    "torch": {"KERAS_BACKEND": "torch"},
    "jax": {"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "2"},
    "tensorflow": {"KERAS_BACKEND": "tensorflow", "KERAS_DIST_CPU_DEVICES": "2"},
}
_KERAS_DIST_ENTRIES = ["callback", "trainer", "trainer_global"]
# PyTorch's other jobs (a plain model under a global policy, a model built in a
# model-parallel scope) run after those in the same job: one start-up.
_TORCH_ENTRIES = ["plain_global", "model_parallel_scope"]


@pytest.fixture(scope="module")
def plain_keras() -> dict:
    """Plain Keras of this release on one device."""
    return scenarios.reference()


def _job(entry: str, tmp_path) -> list[dict]:
    return run_job(
        "keras_versions_worker.py",
        [entry],
        processes=2,
        env=_ENV[BACKEND],
        output_dir=tmp_path,
    )


def _max_difference(first: list, second: list) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(first, second, strict=True)
    )


def _assert_parity(result: dict, reference: dict) -> None:
    difference = _max_difference(result["weights"], reference["weights"])
    assert difference <= 1e-5, f"weights differ from one device by {difference:.2e}"
    for key, values in reference["history"].items():
        np.testing.assert_allclose(result["history"][key], values, atol=1e-5)


def _assert_each_row_once(results: list[dict], phase: str, ids: range) -> None:
    """Across the processes, each row of `ids` computed on once in `phase`,
    each process its share (the shares differ by at most one row)."""
    per_process = [result["seen"].get(phase, []) for result in results]
    seen = sorted(row for rows in per_process for row in rows)
    assert seen == list(ids), phase
    sizes = [len(rows) for rows in per_process]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) > 0, (phase, sizes)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, list[dict]]:
    """Each entry's results, one per process, from one 2-process job."""
    entries = _KERAS_DIST_ENTRIES + (_TORCH_ENTRIES if BACKEND == "torch" else [])
    results = once_per_run(
        tmp_path_factory,
        "keras_versions",
        lambda directory: _job(",".join(entries), directory),
    )
    return {entry: [result[entry] for result in results] for entry in entries}


def test_a_two_process_job_does_everything_once(plain_keras, job):
    """2 processes (JAX and TensorFlow: 2 devices each, 4 replicas), each way
    the distribution reaches `fit` in turn (one job: one start-up): every row
    read once across the processes, the metric states summed once (a row
    count logs 24 and 17, not 48 and 34), predict and evaluate inside the run
    whole, and the same training as plain Keras on one device."""
    for entry in _KERAS_DIST_ENTRIES:
        try:
            _assert_everything_once(job[entry], plain_keras)
        except AssertionError as error:
            raise AssertionError(f"entry {entry!r}: {error}") from error


def _assert_everything_once(results: list[dict], plain_keras: dict) -> None:
    for result in results:
        history = result["history"]
        assert history["rows"] == [scenarios.TRAIN_ROWS] * scenarios.EPOCHS
        assert history["val_rows"] == [scenarios.VAL_ROWS] * scenarios.EPOCHS
        _assert_parity(result, plain_keras)
        assert result["inner"]["evaluate"]["rows"] == scenarios.VAL_ROWS
        np.testing.assert_allclose(
            result["inner"]["predictions"],
            plain_keras["inner"]["predictions"],
            atol=1e-5,
        )
    if BACKEND != "torch":
        return
    for epoch in range(scenarios.EPOCHS):
        _assert_each_row_once(results, f"train:{epoch}", range(1, 25))
        _assert_each_row_once(results, f"val:{epoch}", range(101, 118))
    inner = [sorted(set(result["seen"]["inner"])) for result in results]
    assert sorted(set(inner[0]) | set(inner[1])) == list(range(101, 118))
    steps = [1] * (scenarios.STEPS * scenarios.EPOCHS)
    for result in results:
        counted = result["torch"]
        if counted["gradient_sync"] == "ddp":
            # One DistributedDataParallel (keras_dist's, lent to Keras 3.16 as
            # `ddp_model` for the run and taken back after it), one gradient
            # bucket a step reduced by it.
            assert counted["ddp_wrappers"] == 1
            assert counted["keras_ddp_model"] == (
                "DistributedDataParallel" if NEWER else "absent"
            )
            assert counted["gradient_all_reduces"] == steps
        else:
            # The gradients averaged after backward: no DDP, Keras 3.16's own
            # kept from wrapping the model by a stand-in.
            assert counted["ddp_wrappers"] == 0
            assert counted["keras_ddp_model"] == ("_NoKerasDDP" if NEWER else "absent")
            assert counted["gradient_all_reduces"] == [0] * len(steps)
        assert counted["ddp_model_after"] == "NoneType"
        # Per step: the gradients in one all-reduce (DDP's bucket, or the flat
        # one after backward), every metric state in one more (keras_dist's
        # flat sum): two a step (Keras 3.16 would add one per metric
        # variable, 5 here). Under DDP the first step has one more: whether
        # some process' loss misses a weight (`unused_weights.agree`).
        first = 3 if counted["gradient_sync"] == "ddp" else 2
        assert counted["all_reduces"] == [first] + [2] * (len(steps) - 1)


@pytest.mark.backend("torch")
def test_a_plain_model_under_a_global_policy_is_keras_own_ddp_once(plain_keras, job):
    """`kd.set_distribution` then a plain model's `fit`: Keras drives (3.16:
    its own DDP; 3.15: nothing). Its adapters do not shard keras_dist's policy
    (every process reads all rows), so the processes run the same steps: no
    hang (3.16 sharded 3 batches 2 + 1), one-device training."""
    for result in job["plain_global"]:
        difference = _max_difference(result["weights"], plain_keras["weights"])
        assert difference <= 1e-5
        assert result["torch"]["ddp_wrappers"] == (1 if NEWER else 0)
        assert sorted(result["seen"]["train:0"]) == list(range(1, 25))


@pytest.mark.backend("torch")
def test_a_model_built_in_a_model_parallel_scope_trains_as_on_keras_3_15(
    plain_keras, job
):
    """Built inside a sharding `kd.ModelParallel`'s scope, the variables stay
    plain (Keras 3.16 would make them DTensors from a layout keras_dist's are
    not: "'tuple' object has no attribute 'device_mesh'"); the run lays them
    out (the hidden kernel split along the model axis), outside Keras' DTensor
    promotion mode, with the metric states global and not summed again."""
    for result in job["model_parallel_scope"]:
        assert result["model_parallel"] == {
            "kernel_built_as": "Parameter",
            "promotion_mode": False,
            "kernel_placements": ["R", "S(1)"],
        }
        assert result["history"]["rows"] == [scenarios.TRAIN_ROWS] * scenarios.EPOCHS
        assert result["history"]["val_rows"] == [scenarios.VAL_ROWS] * scenarios.EPOCHS
        _assert_parity(result, plain_keras)
        assert result["torch"]["ddp_wrappers"] == 0  # DTensor brings its collectives


@pytest.mark.backend("torch")
def test_keras_dist_own_process_group_leaves_plain_keras_models_alone():
    """A one-process job's DTensor layouts need a process group, which
    keras_dist makes itself; Keras 3.16 wraps every model in DDP while a group
    exists. Plain Keras models in that process must not see it: an unbuilt
    model's first predict failed (`DistributedDataParallel is not needed ...`)
    after any keras_dist ModelParallel run in the process."""
    import torch.distributed as torch_distributed

    from keras_dist.backends.torch import placements

    placements.torch_mesh(kd.DeviceMesh((1,), ["model"], kd.list_devices()[:1]))
    assert torch_distributed.is_initialized()
    model = keras.Sequential([keras.layers.Dense(3)])
    x = np.ones((4, 2), "float32")
    np.testing.assert_allclose(
        model.predict(x, verbose=0), keras.ops.convert_to_numpy(model(x)), atol=1e-6
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((4, 3)), verbose=0)
    assert getattr(model, "ddp_model", None) is None
