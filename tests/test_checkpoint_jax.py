"""The Orbax checkpoint engine (issue 12) on 8 simulated CPU devices.

A model trained under 8-way DataParallel is saved through the engine
(`keras_dist.backends.jax.checkpoint`), blocking and in the background, and
restored into a (2, 4) ModelParallel layout that shards a kernel, and into one
device with no distribution: the same predictions, the same optimizer step.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint.keys import saveable_variables
from tests import parity
from tests.multiprocess import WORKERS, run_job
from tests.workers import checkpoint_jax_worker as worker

pytestmark = pytest.mark.backend("jax")

BATCH = 16
TIMEOUT_SECONDS = 60.0


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    return parity.compile_model(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu", name="hidden"),
                keras.layers.Dropout(0.25, name="dropout"),
                keras.layers.Dense(3, activation="softmax", name="head"),
            ]
        )
    )


def _engine():
    from keras_dist.backends.jax import checkpoint  # noqa: PLC0415

    return checkpoint


def _entries(state) -> dict:
    return {
        key: {"shape": list(v.shape), "dtype": str(v.value.dtype)}
        for key, v in state.items()
    }


def _model_parallel() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    return kd.ModelParallel(layout_map=layout_map)


def _fresh_model(distribution) -> keras.Model:
    """The same architecture with every training-state variable built (a
    different random start), laid out by `distribution`."""
    x, y = parity.data(seed=5)
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    keras.utils.set_random_seed(7)
    model = _model()
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0, callbacks=callbacks)
    return model


def _predict(model, distribution) -> np.ndarray:
    x, _ = parity.data()
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    return model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model trained 7 steps under DataParallel on 8 devices, saved blocking
    and in the background: `(model, predictions, {background: directory})`."""
    assert len(keras.distribution.list_devices()) == 8, (
        "run with KERAS_DIST_CPU_DEVICES=8"
    )
    distribution = kd.DataParallel()
    model = _model()
    x, y = parity.data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    assert int(model.optimizer.iterations.numpy()) == 7
    kernel = model.get_layer("hidden").kernel.value
    assert len(kernel.sharding.device_set) == 8
    state = saveable_variables(model)
    directories = {}
    for background in (False, True):
        directory = tmp_path_factory.mktemp(f"background_{background}")
        pending = _engine().save(directory, state, background=background)
        pending.wait(TIMEOUT_SECONDS)
        assert pending.done()
        directories[background] = directory
    arrays = {key: np.asarray(v.value) for key, v in state.items()}
    predictions = _predict(model, distribution)
    return model, predictions, arrays, directories


def _assert_restored(model, distribution, reference) -> None:
    source, predictions, _, _ = reference
    np.testing.assert_allclose(
        _predict(model, distribution), predictions, atol=1e-6, rtol=0
    )
    assert int(model.optimizer.iterations.numpy()) == int(
        source.optimizer.iterations.numpy()
    )
    for ours, theirs in zip(
        saveable_variables(model).values(),
        saveable_variables(source).values(),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(ours.value), np.asarray(theirs.value), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("background", [False, True])
def test_data_parallel_save_restores_into_model_parallel(saved, background):
    directory = saved[3][background]
    distribution = _model_parallel()
    model = _fresh_model(distribution)
    state = saveable_variables(model)
    kernel = model.get_layer("hidden").kernel
    assert tuple(kernel.value.sharding.spec) == (None, "model")
    # Not the saved values yet: the test can fail.
    assert not np.allclose(np.asarray(kernel.value), saved[2]["layers/dense/vars/0"])

    _engine().load(directory, state, _entries(state))

    # Restored into the current layout: each device holds a quarter.
    assert tuple(kernel.value.sharding.spec) == (None, "model")
    assert {s.data.shape for s in kernel.value.addressable_shards} == {(6, 4)}
    _assert_restored(model, distribution, saved)


@pytest.mark.parametrize("background", [False, True])
def test_data_parallel_save_restores_on_one_device(saved, background):
    directory = saved[3][background]
    model = _fresh_model(None)
    state = saveable_variables(model)
    _engine().load(directory, state, _entries(state))
    kernel = model.get_layer("hidden").kernel.value
    assert len(kernel.sharding.device_set) == 1
    _assert_restored(model, None, saved)


def test_seed_generator_and_metric_states_are_saved(saved):
    keys = set(saved[2])
    assert any("seed_generators" in key for key in keys)
    assert any(key.startswith("metrics/vars/") for key in keys)
    assert any(key.startswith("optimizer/vars/") for key in keys)


def test_read_arrays_equals_the_saved_values(saved):
    _, _, arrays, directories = saved
    entries = {
        k: {"shape": list(a.shape), "dtype": str(a.dtype)} for k, a in arrays.items()
    }
    read = _engine().read_arrays(directories[True], entries)
    assert set(read) == set(arrays)
    for key, array in arrays.items():
        assert isinstance(read[key], np.ndarray)
        assert read[key].dtype == array.dtype
        np.testing.assert_array_equal(read[key], array)
    # A subset reads only those keys.
    subset = {"layers/dense/vars/0": entries["layers/dense/vars/0"]}
    assert list(_engine().read_arrays(directories[False], subset)) == list(subset)


def test_assign_arrays_lays_full_arrays_out_the_current_way(saved):
    _, _, arrays, _ = saved
    distribution = _model_parallel()
    model = _fresh_model(distribution)
    state = saveable_variables(model)
    _engine().assign_arrays(state, arrays)
    kernel = model.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == (None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(6, 4)}
    _assert_restored(model, distribution, saved)


def test_assign_arrays_refuses_a_wrong_shape_or_missing_key(saved):
    _, _, arrays, _ = saved
    model = _fresh_model(None)
    state = saveable_variables(model)
    wrong = dict(arrays, **{"layers/dense/vars/0": np.zeros((3, 3), "float32")})
    with pytest.raises(ValueError, match=r"layers/dense/vars/0.*\(3, 3\)"):
        _engine().assign_arrays(state, wrong)
    missing = {k: a for k, a in arrays.items() if k != "optimizer/vars/0"}
    with pytest.raises(ValueError, match="optimizer/vars/0"):
        _engine().assign_arrays(state, missing)


def _copy(saved, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(saved[3][False], target)
    return target


def _assert_incomplete(directory, saved) -> None:
    model = _fresh_model(None)
    state = saveable_variables(model)
    entries = _entries(state)
    with pytest.raises(ValueError, match="incomplete"):
        _engine().load(directory, state, entries)
    with pytest.raises(ValueError, match="incomplete"):
        _engine().read_arrays(directory, entries)


def test_killed_before_the_commit_is_refused(saved, tmp_path):
    # What a process killed mid-save leaves: Orbax's temporary directory only.
    directory = _copy(saved, tmp_path)
    (directory / "orbax").rename(directory / "orbax.orbax-checkpoint-tmp")
    _assert_incomplete(directory, saved)


def test_killed_before_the_final_metadata_is_refused(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    (directory / "orbax" / "_CHECKPOINT_METADATA").unlink()
    _assert_incomplete(directory, saved)


def test_killed_before_anything_is_refused(tmp_path, saved):
    _assert_incomplete(tmp_path, saved)


def test_load_refuses_another_model(saved):
    keras.utils.set_random_seed(1)
    model = parity.compile_model(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, name="hidden"),
                keras.layers.Dense(3, name="head"),
            ]
        )
    )
    model.build((None, 6))
    state = {"layers/dense/vars/0": model.get_layer("hidden").kernel}
    entries = {"layers/dense/vars/0": {"shape": [6, 16], "dtype": "float32"}}
    with pytest.raises(ValueError, match=r"layers/dense/vars/0.*\(6, 16\)"):
        _engine().load(saved[3][False], state, entries)
    with pytest.raises(ValueError, match="no entry"):
        _engine().load(saved[3][False], state, {})


def test_save_needs_an_existing_directory(saved, tmp_path):
    state = saveable_variables(saved[0])
    with pytest.raises(ValueError, match="existing directory"):
        _engine().save(tmp_path / "absent", state, background=False)


def test_background_save_during_fit_keeps_the_values_it_was_given(tmp_path):
    """Training goes on (and JAX donates the old buffers) while the save
    writes: the checkpoint holds the values at the step that saved."""

    class SaveAtStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch != 2:
                return
            state = saveable_variables(self.model)  # `model` syncs JAX's state
            self.pending = _engine().save(tmp_path, state, background=True)
            self.values = {k: np.array(v.value) for k, v in state.items()}
            self.entries = _entries(state)

    saver = SaveAtStep()
    model = _model()
    x, y = parity.data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel()), saver],
    )
    saver.pending.wait(TIMEOUT_SECONDS)
    kernel = "layers/dense/vars/0"
    # Training went on after the save.
    assert not np.allclose(
        np.asarray(model.get_layer("hidden").kernel.value), saver.values[kernel]
    )
    read = _engine().read_arrays(tmp_path, saver.entries)
    for key, value in saver.values.items():
        np.testing.assert_array_equal(read[key], value)
    assert int(read["optimizer/vars/0"]) == 3


def test_a_process_killed_while_saving_leaves_a_refused_checkpoint(tmp_path):
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.update(KERAS_BACKEND="jax", KERAS_DIST_CPU_DEVICES="1")
    process = subprocess.run(
        [
            sys.executable,
            str(WORKERS / "checkpoint_jax_worker.py"),
            "kill",
            str(directory),
            str(tmp_path / "unused.json"),
        ],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    entries = {
        f"layers/big/vars/{i}": {"shape": [1024, 8192], "dtype": "float32"}
        for i in range(4)
    }
    with pytest.raises(ValueError, match="incomplete"):
        _engine().load(directory, {}, entries)
    with pytest.raises(ValueError, match="incomplete"):
        _engine().read_arrays(directory, entries)


def _bytes_under(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


TWO_BY_FOUR = {"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "4"}


def _fresh_worker_model() -> keras.Model:
    x, y = worker.data()
    net = worker.model(seed=7)
    net.fit(x[: worker.BATCH], y[: worker.BATCH], batch_size=worker.BATCH, verbose=0)
    return net


def _assert_values(state: dict, values: dict, atol: float = 1e-6) -> None:
    assert set(values) == set(state)
    for key, variable in state.items():
        np.testing.assert_allclose(
            np.asarray(variable.value), np.asarray(values[key]), atol=atol, rtol=0
        )


@pytest.fixture(scope="module")
def one_process_save(tmp_path_factory) -> tuple:
    """A checkpoint written by this process, for the job below to restore:
    its directory (`load` in the job's directory) and the saved state."""
    x, y = worker.data()
    net = worker.model(seed=1)
    steps = 3 * worker.BATCH
    net.fit(x[:steps], y[:steps], batch_size=worker.BATCH, verbose=0)
    directory = tmp_path_factory.mktemp("jobs") / "load"
    directory.mkdir()
    state = saveable_variables(net)
    _engine().save(directory, state, background=False).wait(TIMEOUT_SECONDS)
    (directory / "entries.json").write_text(json.dumps(_entries(state)))
    return directory, state


JOB = ["save", "load", "refit"]


@pytest.fixture(scope="module")
def job(one_process_save) -> tuple[dict[str, list[dict]], pathlib.Path]:
    """The 2-process runs of the tests below in one job (each start-up costs
    seconds: CI's time), each scenario's results and the job's directory:
    `save` writes `save` there, `load` restores `load`, `refit` fits again."""
    directory = one_process_save[0].parent
    results = run_job(
        "checkpoint_jax_worker.py",
        [",".join(JOB), str(directory)],
        processes=2,
        env=TWO_BY_FOUR,
        output_dir=directory / "job",
    )
    return {name: [result[name] for result in results] for name in JOB}, directory


def test_two_processes_write_their_own_shards_restored_in_one(job):
    """A (2, 4) ModelParallel job of 2 processes x 4 devices whose `model` axis
    spans the processes: each process writes its half of the sharded kernel
    (the variables compared exactly: equal variables predict the same)."""
    results, directory = job[0]["save"], job[1] / "save"
    for result in results:
        assert result["kernel_shards"] == [[64, 128]]
    # The kernel and its 2 Adam slots: 3 x 64 x 256 float32 = 192 KiB, half
    # in each process' files (what is replicated is small).
    written = [_bytes_under(directory / "orbax" / f"ocdbt.process_{i}") for i in (0, 1)]
    sharded = 3 * 64 * 256 * 4
    for size in written:
        assert 0.45 * sharded < size < 0.5 * sharded + 32 * 1024, written

    net = _fresh_worker_model()
    state = saveable_variables(net)
    _engine().load(directory, state, results[0]["entries"])
    _assert_values(state, results[0]["values"])
    assert int(net.optimizer.iterations.numpy()) == 3


def test_one_process_save_restored_in_two(one_process_save, job):
    _, state = one_process_save
    for result in job[0]["load"]:
        assert result["kernel_shards"] == [[64, 128]]
        _assert_values(state, result["values"])


def test_read_arrays_in_a_torch_process(saved, tmp_path):
    """Another backend's process reads a JAX checkpoint (JAX kept on the CPU)."""
    _, _, arrays, directories = saved
    directory = tmp_path / "checkpoint"
    shutil.copytree(directories[True], directory)
    entries = {
        k: {"shape": list(a.shape), "dtype": str(a.dtype)} for k, a in arrays.items()
    }
    (directory / "entries.json").write_text(json.dumps(entries))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env.pop("JAX_PLATFORMS", None)
    env["KERAS_BACKEND"] = "torch"
    output = tmp_path / "read.json"
    process = subprocess.run(
        [
            sys.executable,
            str(WORKERS / "checkpoint_jax_worker.py"),
            "read",
            str(directory),
            str(output),
        ],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["backend"] == "torch"
    assert result["jax_platforms"] == "cpu"
    assert set(result["values"]) == set(arrays)
    for key, array in arrays.items():
        assert result["dtypes"][key] == str(array.dtype)
        np.testing.assert_array_equal(np.asarray(result["values"][key]), array)


@pytest.mark.parametrize("background", [False, True])
def test_kd_checkpoint_and_restore_through_the_engine(tmp_path, background):
    """End to end: `kd.Checkpoint` saves with the Orbax engine during an
    8-way DataParallel fit, `kd.restore` loads into (2, 4) ModelParallel."""
    model = _model()
    x, y = parity.data()
    data_parallel = kd.DataParallel()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(data_parallel),
            kd.Checkpoint(tmp_path, save_on_background=background),
        ],
    )
    predictions = _predict(model, data_parallel)
    distribution = _model_parallel()
    with distribution.scope():
        restored = _model()
        restored.build((None, 6))
        kd.restore(restored, tmp_path)
    kernel = restored.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == (None, "model")
    np.testing.assert_allclose(
        _predict(restored, distribution), predictions, atol=1e-6, rtol=0
    )
    assert int(restored.optimizer.iterations.numpy()) == 14


def test_a_model_laid_out_across_processes_fits_again(job):
    """A second fit and a predict (each with its own DistributeCallback) of a
    model whose kernel spans the processes after the first fit, as after a
    `kd.restore` in a multi-process job: they train as one process does."""
    results = job[0]["refit"]
    x, y = worker.data()
    net = worker.model()
    for _ in range(2):
        net.fit(
            x[: worker.BATCH],
            y[: worker.BATCH],
            batch_size=worker.BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(worker.model_parallel())],
        )
    expected = net.predict(
        x[: worker.BATCH],
        verbose=0,
        callbacks=[kd.DistributeCallback(worker.model_parallel())],
    )
    for result in results:
        assert result["kernel_shards"] == [[64, 128]]
        assert result["iterations"] == 2
        np.testing.assert_allclose(result["predictions"], expected, atol=1e-5)
    _assert_values(saveable_variables(net), results[0]["values"], atol=1e-5)


def test_one_device_a_process_saves_each_epoch_and_resumes(tmp_path):
    """2 processes x 1 device (one GPU a process): Keras resets the metrics,
    laid out across the processes, at each epoch's start; the arrays that
    makes are whole global arrays that get_weights, the metrics and the
    epoch-end saves read, and a resume goes on as one process trains."""
    from tests.workers import checkpoint_one_device_worker as one  # noqa: PLC0415

    directory = tmp_path / "checkpoints"
    results = run_job(
        "checkpoint_one_device_worker.py",
        [str(directory)],
        processes=2,
        env={"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "1"},
        output_dir=tmp_path / "job",
    )
    x, y = one.data()
    reference = one.model(1)
    weights: list = []  # at each epoch's end
    keep_weights = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(reference.get_weights())
    )
    history = reference.fit(
        x,
        y,
        batch_size=one.BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keep_weights],
    ).history
    for result in results:
        # Nothing malformed; the metrics read as reset; every save was made.
        assert result["malformed"] == [], result["malformed"]
        assert result["malformed_at_end"] == [], result["malformed_at_end"]
        assert result["metrics"] == {"loss": 0.0, "accuracy": 0.0}
        assert result["steps"] == [5, 10, 15]
        assert result["iterations"] == 15
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(
                result["history"][key], history[key][:2], atol=1e-5
            )
        for seen, expected in zip(result["weights"], weights[0], strict=True):
            np.testing.assert_allclose(seen, expected, atol=1e-5, rtol=0)
        for ours, expected in zip(result["final"], weights[2], strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
