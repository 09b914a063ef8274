"""One writer: saving, BackupAndRestore, TensorBoard and CSVLogger.

Multi-process jobs (2 real processes, JAX with 2 CPU devices each, PyTorch on
gloo) call what users call on every process; process 0 writes, the files are
complete when any process goes on, and nothing else is left behind. In one
process, BackupAndRestore resumes a distributed `fit` on every backend.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.conftest import BACKEND
from tests.multiprocess import run_job

TWO_PROCESSES = pytest.mark.backend("jax", "torch", "tensorflow")


def _job(name: str, args: list[str], tmp_path) -> list[dict]:
    env = {"KERAS_BACKEND": BACKEND}
    if BACKEND != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    return run_job(
        "saving_worker.py",
        [*args, str(files)],
        processes=2,
        env=env,
        output_dir=tmp_path / name,
    )


def _assert_close(ours: list, reference: list) -> None:
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@TWO_PROCESSES
def test_every_process_saves_after_fit_and_loads_one_complete_file(tmp_path):
    results = _job("save", ["save"], tmp_path)
    for result in results:
        # m.keras, saved.keras and w.weights.h5 loaded right after saving, on
        # every process, equal the trained weights.
        assert result["loaded_error"] < 1e-6
        _assert_close(result["weights"], results[0]["weights"])
    files = results[0]["files"]
    # One writer: no temporary or scratch files, one set of TensorBoard events
    # (process 1's TensorBoard wrote its model summary in `set_model`).
    expected = ["epochs.csv", "m.keras", "saved.keras", "w.weights.h5"]
    if BACKEND != "tensorflow":  # process 0 saved it alone
        expected.insert(2, "only0.weights.h5")
    assert [f for f in files if not f.startswith("logs/")] == expected
    events = [f.rsplit("/", 1)[0] for f in files if f.startswith("logs/")]
    assert events == ["logs/train", "logs/validation"], files
    csv = (tmp_path / "files" / "epochs.csv").read_text().splitlines()
    assert len(csv) == 3  # header and two epochs, written once


# The one writer is the same code on every backend; TensorFlow is the one with
# a resume of its own to check (Keras' restore needs the strategy's scope).
# `kd.Checkpoint`'s jobs (test_checkpoint_jobs.py) resume on every backend.
@pytest.mark.backend("tensorflow")
def test_backup_and_restore_resumes_an_interrupted_job_in_a_new_job(tmp_path):
    # The uninterrupted run (no backup) first, in the job interrupted after it
    # (one start-up: CI's time); the resumed job is a new one.
    first = _job("interrupted", ["backup", "uninterrupted,interrupted"], tmp_path)
    for result in first:
        assert result["interrupted"]["error"] == "interrupted at epoch 2"
        assert result["files"] == [
            "backup/latest.weights.h5",
            "backup/training_metadata.json",
        ]
    resumed = _job("resumed", ["backup", "resumed"], tmp_path)
    uninterrupted = first[0]["uninterrupted"]
    _assert_close(uninterrupted["weights"], uninterrupted["plain_weights"])
    for result in resumed:
        assert result["epochs_run"] == 2  # epochs 2 and 3, from the backup
        assert result["files"] == []  # the backup is deleted when fit ends
        _assert_close(result["weights"], uninterrupted["weights"])


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def _net(how: str, distribution):
    keras.utils.set_random_seed(5)
    layers = [
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ]
    if how == "trainer":

        class Net(kd.Trainer, keras.Sequential):
            pass

        net = Net(layers, distribution=distribution)
    elif how == "scope":
        with distribution.scope():
            net = keras.Sequential(layers)
    else:
        net = keras.Sequential(layers)
    net.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    return net


@pytest.mark.parametrize("how", ["callback", "scope", "trainer"])
def test_backup_and_restore_resumes_a_distributed_fit(how, tmp_path):
    """TensorFlow built the optimizer outside the strategy's scope when the
    backup was loaded: "Need to be inside `with strategy.scope()`"."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    distribution = kd.DataParallel()

    def fit(net, *callbacks):
        if how != "trainer":  # a model built in the scope too
            callbacks = (kd.DistributeCallback(distribution), *callbacks)
        return net.fit(
            x,
            y,
            batch_size=8,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            _net(how, distribution),
            keras.callbacks.BackupAndRestore(backup),
            Interrupt(),
        )
    keras.distribution.set_distribution(None)
    resumed = _net(how, distribution)
    history = fit(resumed, keras.callbacks.BackupAndRestore(backup))
    assert len(history.history["loss"]) == 2
    keras.distribution.set_distribution(None)
    plain = _net("plain", None)
    plain.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0)
    _assert_close(resumed.get_weights(), plain.get_weights())
    assert not (tmp_path / "backup").exists()


def test_a_save_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
    """Process 0 writes to a temporary name and renames it when complete."""
    from keras_dist.training import saving  # noqa: PLC0415

    target = tmp_path / "m.weights.h5"
    target.write_bytes(b"the previous, complete file")

    def save_then_die(model, filepath, overwrite=True):
        with open(filepath, "wb") as handle:
            handle.write(b"half a fi")
        raise KeyboardInterrupt  # killed while writing

    with pytest.raises(KeyboardInterrupt):
        saving._write_whole(save_then_die, None, str(target), {}, (), {})
    assert target.read_bytes() == b"the previous, complete file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.weights.h5"]

    def save(model, filepath, overwrite=True):
        assert filepath != str(target)  # never written in place
        with open(filepath, "wb") as handle:
            handle.write(b"new")

    saving._write_whole(save, None, str(target), {}, (), {})
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.weights.h5"]


def test_model_checkpoint_directories_appearing_meanwhile_are_accepted(tmp_path):
    """Every process' ModelCheckpoint sees the directory missing, then creates
    it: all but the first used to fail with FileExistsError."""
    from keras.src.callbacks import model_checkpoint  # noqa: PLC0415

    from keras_dist.keras_compat.saving import tolerate_existing_directories  # noqa: PLC0415

    made = tmp_path / "made-by-another-process"
    made.mkdir()
    tolerate_existing_directories()
    model_checkpoint.file_utils.makedirs(str(made))  # no error
    model_checkpoint.file_utils.makedirs(str(tmp_path / "new" / "nested"))
    assert (tmp_path / "new" / "nested").is_dir()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(FileExistsError):  # a file in the way is still an error
        model_checkpoint.file_utils.makedirs(str(a_file))
