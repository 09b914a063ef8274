"""`kd.Trainer(checkpoint=...)`: every `fit` saves with a `kd.Checkpoint` and
resumes from the latest checkpoint (issue 12).

PyTorch, in one process (the mixin is backend-neutral).
"""

from __future__ import annotations

import os
import shutil

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store

# The mixin's plumbing is the same on every backend (each backend's resume is
# in test_checkpoint_resume.py and test_checkpoint_jobs.py): one backend keeps
# the suite short.
pytestmark = pytest.mark.backend("torch")

ROWS, BATCH = 32, 8  # 4 steps an epoch


class Net(kd.Trainer, keras.Model):
    pass


def _model(**trainer_options) -> Net:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    model = Net(inputs, outputs, name="trainer_checkpoint", **trainer_options)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")


class _Epochs(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def _fit(model: Net, epochs: int, callbacks: list | None = None) -> list[int]:
    recorder = _Epochs()
    x, y = _data()
    keras.utils.set_random_seed(7)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[*(callbacks or []), recorder],
    )
    return recorder.epochs


def _steps(directory) -> list[int]:
    return sorted(
        int(name.removeprefix("step-"))
        for name in os.listdir(directory)
        if name.startswith("step-")
    )


def _assert_weights_equal(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 epochs in one fit, checkpointing into a directory of its own."""
    directory = tmp_path_factory.mktemp("uninterrupted") / "ck"
    model = _model(distribution=kd.DataParallel(), checkpoint=directory)
    assert _fit(model, 4) == [0, 1, 2, 3]
    return model.get_weights()


def test_fit_saves_and_a_second_fit_resumes_where_the_first_ended(
    uninterrupted, tmp_path
):
    directory = tmp_path / "ck"
    first = _model(distribution=kd.DataParallel(), checkpoint=str(directory))
    assert isinstance(first.checkpoint, kd.Checkpoint)
    assert first.checkpoint.directory == str(directory)
    assert _fit(first, 2) == [0, 1]
    # save_freq="epoch", max_to_keep=3: one checkpoint an epoch, 4 steps each.
    assert _steps(directory) == [4, 8]
    assert store.latest_step(str(directory)) == 8

    # A new process would build a new model: it resumes at epoch 2.
    second = _model(distribution=kd.DataParallel(), checkpoint=directory)
    assert _fit(second, 4) == [2, 3]
    assert _steps(directory) == [8, 12, 16]
    assert int(keras.ops.convert_to_numpy(second.optimizer.iterations)) == 16
    _assert_weights_equal(second.get_weights(), uninterrupted)

    # The same model again: nothing left to train.
    assert _fit(second, 4) == []
    _assert_weights_equal(second.get_weights(), uninterrupted)


def test_a_checkpoint_instance_keeps_its_options(uninterrupted, tmp_path):
    directory = tmp_path / "ck"
    checkpoint = kd.Checkpoint(directory, save_freq=3, max_to_keep=None)
    model = _model(distribution=kd.DataParallel(), checkpoint=checkpoint)
    assert model.checkpoint is checkpoint
    assert _fit(model, 2) == [0, 1]
    # Every 3 steps (mid-epoch), and the state fit ends with (step 8).
    assert _steps(directory) == [3, 6, 8]

    resumed = _model(
        distribution=kd.DataParallel(),
        checkpoint=kd.Checkpoint(directory, save_freq=3, max_to_keep=None),
    )
    # Step 8 ends epoch 1: the resume starts at epoch 2; save_freq counts on
    # from the restored step.
    assert _fit(resumed, 4) == [2, 3]
    assert _steps(directory) == [3, 6, 8, 11, 14, 16]
    _assert_weights_equal(resumed.get_weights(), uninterrupted)
    # Mid-epoch: from step 6 (epoch 1's third batch) once the later ones go.
    for step in (8, 11, 14, 16):
        shutil.rmtree(store.step_directory(str(directory), step))
    again = _model(
        distribution=kd.DataParallel(),
        checkpoint=kd.Checkpoint(directory, save_freq=3, max_to_keep=None),
    )
    assert _fit(again, 4) == [1, 2, 3]
    assert _steps(directory) == [3, 6, 9, 12, 15, 16]
    _assert_weights_equal(again.get_weights(), uninterrupted)


def test_checkpoint_without_a_distribution(tmp_path):
    directory = tmp_path / "ck"
    model = _model(checkpoint=directory)
    assert model.distribution is None
    assert _fit(model, 1) == [0]
    assert _steps(directory) == [4]
    resumed = _model(checkpoint=directory)
    assert _fit(resumed, 2) == [1]
    assert _steps(directory) == [4, 8]


def test_evaluate_and_predict_do_not_checkpoint(tmp_path):
    directory = tmp_path / "ck"
    model = _model(distribution=kd.DataParallel(), checkpoint=directory)
    x, y = _data()
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    model.predict(x, batch_size=BATCH, verbose=0)
    assert not directory.exists() or _steps(directory) == []


def test_a_checkpoint_in_callbacks_too_is_refused(tmp_path):
    model = _model(distribution=kd.DataParallel(), checkpoint=tmp_path / "a")
    with pytest.raises(ValueError, match="use one or the other"):
        _fit(model, 1, callbacks=[kd.Checkpoint(tmp_path / "b")])
    with pytest.raises(ValueError, match="must then be a list"):
        model.fit(
            *_data(), epochs=1, verbose=0, callbacks=keras.callbacks.CallbackList()
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # Without `checkpoint=`, a Checkpoint in the callbacks is the usual way.
    plain = _model(distribution=kd.DataParallel())
    assert plain.checkpoint is None
    assert _fit(plain, 1, callbacks=[kd.Checkpoint(tmp_path / "b")]) == [0]
    assert _steps(tmp_path / "b") == [4]


@pytest.mark.parametrize("wrong", [3, ["ck"], keras.callbacks.BackupAndRestore])
def test_checkpoint_must_be_a_directory_or_a_checkpoint(wrong):
    with pytest.raises(TypeError, match=r"Trainer\(checkpoint=\.\.\.\)"):
        _model(checkpoint=wrong)
