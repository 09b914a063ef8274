"""TensorFlow's checkpoint engine (`tf.train.Checkpoint`), driven directly.

Saved by 4 replicas (`kd.DataParallel` on simulated devices: mirrored weights,
sync-on-read metric states), restored on 1 device and onto 4 replicas; saved by
2 workers (`MultiWorkerMirroredStrategy`, real processes) and restored in 1.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.backends.tensorflow import checkpoint as engine
from keras_dist.checkpoint.keys import saveable_variables
from tests.multiprocess import run_job
from tests.workers import checkpoint_tf_worker as worker

pytestmark = pytest.mark.backend("tensorflow")

DEVICES = 4
FILES = ["ckpt.data-00000-of-00001", "ckpt.index"]


def _entries(state):
    return {
        key: {"shape": [int(d) for d in v.shape], "dtype": str(v.dtype)}
        for key, v in state.items()
    }


def _predict(model, x):
    return np.asarray(model(x, training=False))


def _four_devices():
    return kd.DataParallel(devices=kd.list_devices()[:DEVICES])


def _mirrored_model():
    """Built in the distribution's scope: its variables stay mirrored between
    calls (a model built outside is an ordinary one again after each)."""
    with _four_devices().scope():
        return worker.model()


def _train(model, seed=0):
    """A few steps on 4 replicas (the last batch padded: 45 rows by 12)."""
    x, y = worker.data()
    order = np.random.default_rng(seed).permutation(len(x)) if seed else slice(None)
    model.fit(
        x[order],
        y[order],
        batch_size=worker.BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(_four_devices())],
    )
    return model


def _on_one_device():
    """A fresh model, no distribution, built with its optimizer and metrics."""
    model = worker.model()
    x, y = worker.data()
    model.build((None, 5))
    model.optimizer.build(model.trainable_variables)
    model.evaluate(x[:4], y[:4], verbose=0)  # builds the compiled metrics
    return model


def _replicas(variable):
    return getattr(variable.value, "values", (variable.value,))


@pytest.fixture(scope="module")
def four_replicas():
    assert len(kd.list_devices()) >= DEVICES, "run with KERAS_DIST_CPU_DEVICES=8"
    return _train(_mirrored_model())


@pytest.fixture(scope="module")
def saved(four_replicas, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tf_four") / "step"
    directory.mkdir()
    state = saveable_variables(four_replicas)
    engine.save(directory, state, background=False).wait(60)
    return directory, _entries(state)


@pytest.mark.parametrize("background", [False, True])
def test_four_replicas_restore_on_one_device(four_replicas, tmp_path, background):
    state = saveable_variables(four_replicas)
    # What was saved is laid out by the strategy: one value per replica.
    kernel = state["layers/dense/vars/0"]
    assert type(kernel.value).__name__ == "MirroredVariable"
    assert len(_replicas(kernel)) == DEVICES
    assert type(state["metrics/vars/0"].value).__name__ == "SyncOnReadVariable"
    assert any("seed_generators" in key for key in state)
    pending = engine.save(tmp_path, state, background=background)
    pending.wait(60)
    assert pending.done()
    assert sorted(os.listdir(tmp_path)) == FILES

    restored = _on_one_device()
    target = saveable_variables(restored)
    assert target.keys() == state.keys()
    engine.load(tmp_path, target, _entries(state))
    x, _ = worker.data()
    np.testing.assert_allclose(
        _predict(restored, x), _predict(four_replicas, x), atol=1e-6, rtol=0
    )
    assert int(restored.optimizer.iterations.numpy()) == 4
    assert int(four_replicas.optimizer.iterations.numpy()) == 4
    for key, variable in state.items():
        # Metric states: the sum over the 4 replicas, now on one device.
        np.testing.assert_array_equal(target[key].numpy(), variable.numpy(), key)


def test_read_arrays_equals_the_saved_values(four_replicas, saved):
    directory, entries = saved
    arrays = engine.read_arrays(directory, entries)
    state = saveable_variables(four_replicas)
    assert arrays.keys() == state.keys()
    for key, variable in state.items():
        assert str(arrays[key].dtype) == entries[key]["dtype"]
        np.testing.assert_array_equal(arrays[key], np.asarray(variable.numpy()), key)


def test_assign_arrays_and_load_onto_four_replicas(four_replicas, saved):
    """Full arrays land on every replica; a metric state is split among the
    replicas so that their sum is the saved one."""
    directory, entries = saved
    x, _ = worker.data()
    expected = _predict(four_replicas, x)
    other = _train(_mirrored_model(), seed=5)  # other values, same 4 replicas
    state = saveable_variables(other)
    assert np.abs(_predict(other, x) - expected).max() > 1e-3
    arrays = engine.read_arrays(directory, entries)

    engine.assign_arrays(state, arrays)
    for key, variable in state.items():
        if key.startswith("metrics/"):
            np.testing.assert_allclose(variable.numpy(), arrays[key], rtol=1e-6)
            assert len(_replicas(variable)) == DEVICES
        else:
            for replica in _replicas(variable):
                np.testing.assert_array_equal(replica.numpy(), arrays[key], key)
    np.testing.assert_allclose(_predict(other, x), expected, atol=1e-6, rtol=0)

    _train(other, seed=6)
    assert np.abs(_predict(other, x) - expected).max() > 1e-3
    engine.load(directory, state, entries)
    kernel = state["layers/dense/vars/0"]
    assert len(_replicas(kernel)) == DEVICES
    for replica in _replicas(kernel):
        np.testing.assert_array_equal(replica.numpy(), arrays["layers/dense/vars/0"])
    np.testing.assert_allclose(_predict(other, x), expected, atol=1e-6, rtol=0)
    assert int(other.optimizer.iterations.numpy()) == 4


def test_background_saves_hold_the_values_of_their_call(four_replicas, tmp_path):
    state = saveable_variables(four_replicas)
    key = "layers/dense/vars/0"
    kernel = state[key]
    original = np.asarray(kernel.numpy())
    entries = _entries(state)
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    try:
        first = engine.save(tmp_path / "1", state, background=True)
        kernel.assign(original + 100.0)  # right after `save` returned
        first.wait(60)
        kept = engine.read_arrays(tmp_path / "1", {key: entries[key]})[key]
        np.testing.assert_array_equal(kept, original)
        # The same checkpoint object writes again: the new values, not its
        # host copy of the first call's.
        engine.save(tmp_path / "2", state, background=True).wait(60)
        again = engine.read_arrays(tmp_path / "2", {key: entries[key]})[key]
        np.testing.assert_array_equal(again, original + 100.0)
    finally:
        kernel.assign(original)


def test_a_failed_write_is_reported_by_wait_then_saving_goes_on(
    four_replicas, tmp_path
):
    """TensorFlow writes `ckpt_temp/part-*` first; a file in its place makes
    the write fail, on TensorFlow's writer thread for a background save."""
    state = saveable_variables(four_replicas)
    for background in (True, False):
        blocked = tmp_path / f"blocked-{background}"
        blocked.mkdir()
        (blocked / "ckpt_temp").write_text("in the way")
        with pytest.raises(RuntimeError, match="Process 0: TensorFlow"):
            engine.save(blocked, state, background=background).wait(60)
        assert "ckpt.index" not in os.listdir(blocked)
        # Reported once: the next save is not failed by this one's error.
        fine = tmp_path / f"fine-{background}"
        fine.mkdir()
        engine.save(fine, state, background=background).wait(60)
        assert sorted(os.listdir(fine)) == FILES


def test_an_unfinished_save_is_refused(four_replicas, saved, tmp_path):
    directory, entries = saved
    state = saveable_variables(_on_one_device())
    cases = {
        "ckpt.index is missing": lambda d: (d / "ckpt.index").unlink(),
        "data files": lambda d: (d / FILES[0]).unlink(),
        "damaged or incomplete": lambda d: (d / FILES[0]).write_bytes(b"\0" * 8),
    }
    for message, damage in cases.items():
        broken = tmp_path / message.replace(" ", "_")
        shutil.copytree(directory, broken)
        damage(broken)
        with pytest.raises(ValueError, match=message):
            engine.read_arrays(broken, entries)
        with pytest.raises(ValueError, match=message):
            engine.load(broken, state, entries)
    with pytest.raises(ValueError, match="No checkpoint directory"):
        engine.read_arrays(tmp_path / "absent", entries)


def test_load_refuses_another_model(saved):
    directory, entries = saved
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(9)])
    state = saveable_variables(model)
    with pytest.raises(ValueError, match="but the model's variable has shape"):
        engine.load(directory, state, entries)
    changed = dict(entries)
    changed["layers/dense/vars/0"] = {"shape": [5, 9], "dtype": "float32"}
    with pytest.raises(ValueError, match="its manifest says"):
        engine.read_arrays(directory, changed)
    with pytest.raises(ValueError, match="has no value for"):
        engine.read_arrays(
            directory, {"layers/conv/vars/0": entries["layers/dense/vars/0"]}
        )
    with pytest.raises(TypeError, match="Keras variables"):
        engine.save(directory, {"w": np.zeros(3)}, background=False)


def test_read_arrays_on_another_backend(four_replicas, saved):
    """A JAX process reads the TensorFlow checkpoint (cross-backend restore)
    without starting Keras' TensorFlow backend."""
    directory, entries = saved
    code = (
        "import json, sys\n"
        "from keras_dist.backends.tensorflow.checkpoint import read_arrays\n"
        "arrays = read_arrays(sys.argv[1], json.loads(sys.argv[2]))\n"
        "assert 'keras.src.backend.tensorflow' not in sys.modules\n"
        "print(json.dumps({k: v.tolist() for k, v in arrays.items()}))\n"
    )
    keys = ["layers/dense/vars/0", "optimizer/vars/0", "metrics/vars/0"]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")},
        "KERAS_BACKEND": "jax",
    }
    wanted = json.dumps({key: entries[key] for key in keys})
    result = subprocess.run(
        [sys.executable, "-c", code, str(directory), wanted],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=pathlib.Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    arrays = json.loads(result.stdout.strip().splitlines()[-1])
    state = saveable_variables(four_replicas)
    for key in keys:
        np.testing.assert_array_equal(arrays[key], np.asarray(state[key].numpy()))


def test_two_workers_write_restored_in_one_process(tmp_path):
    """Every worker writes (metric states are all-reduced on read); worker 1
    into a temporary directory of its own, removed afterwards."""
    directory = tmp_path / "step"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"KERAS_BACKEND": "tensorflow", "TMPDIR": str(scratch)}
    results = run_job(
        "checkpoint_tf_worker.py",
        [str(directory), "1"],
        processes=2,
        env=env,
        output_dir=tmp_path / "job",
        timeout=180,
    )
    assert [r["kernel_type"] for r in results] == ["MirroredVariable"] * 2
    assert results[0]["files"] == FILES
    assert sorted(os.listdir(directory)) == FILES
    assert sorted(os.listdir(f"{directory}-first")) == FILES
    assert not [n for n in os.listdir(scratch) if n.startswith("keras_dist-tf-")]
    written = results[0]
    assert results[1]["predictions"] == written["predictions"]

    restored = _on_one_device()
    state = saveable_variables(restored)
    engine.load(directory, state, written["entries"])
    x, _ = worker.data()
    np.testing.assert_allclose(
        _predict(restored, x), written["predictions"], atol=1e-6, rtol=0
    )
    assert int(restored.optimizer.iterations.numpy()) == written["iterations"] == 8
    assert written["first_iterations"] == 4  # the first of two background saves
    for key, variable in state.items():
        # Metric states: the sum over both workers' replicas.
        np.testing.assert_allclose(variable.numpy(), written["values"][key], rtol=1e-6)


def test_kd_checkpoint_on_four_replicas_then_kd_restore_on_one_device(tmp_path):
    """The same, through `kd.Checkpoint` (step directories, manifest) and
    `kd.restore`."""
    model = worker.model()
    x, y = worker.data()
    model.fit(
        x,
        y,
        batch_size=worker.BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel(devices=kd.list_devices()[:DEVICES])),
            kd.Checkpoint(tmp_path, save_freq="epoch"),
        ],
    )
    restored = _on_one_device()
    assert kd.restore(restored, tmp_path) == 8
    np.testing.assert_allclose(
        _predict(restored, x), _predict(model, x), atol=1e-6, rtol=0
    )
    assert int(restored.optimizer.iterations.numpy()) == 8
