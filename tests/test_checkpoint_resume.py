"""`kd.Checkpoint`, `kd.restore` and `kd.export` in one process (issue 12).

Every backend: JAX and TensorFlow on 8 simulated devices, PyTorch in one
process. A fit cut short mid-epoch and resumed from its latest checkpoint ends
exactly as the uninterrupted fit: weights, optimizer, metrics of the resumed
epoch, Dropout, BatchNormalization, `shuffle=True` and the state of
ReduceLROnPlateau and EarlyStopping. Multi-process jobs, kills and
preemption: `test_checkpoint_jobs.py`.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store
from tests.conftest import BACKEND
from tests.test_launcher import wait_until
from tests.workers.checkpoint_resume_worker import BATCH, build, data

# TensorFlow: a fit on 8 simulated devices takes 15 to 30 s on 2 busy cores;
# its exact resume (mid-epoch, Dropout, shuffle) is proven across real
# processes in test_checkpoint_jobs.py, its restores in
# test_checkpoint_tensorflow.py.
pytestmark = pytest.mark.backend("jax", "torch")


class _Interrupt(keras.callbacks.Callback):
    """Raises KeyboardInterrupt as epoch `at` ends, its data read whole
    (TensorFlow takes up to minutes on 2 busy cores to tear down a
    distributed iterator left half read; the jobs' kills cut mid-epoch)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at:
            raise KeyboardInterrupt(f"cut as epoch {self.at} ends")


def _fit(directory, *, interrupt_at=None, background=True, **checkpoint_options):
    model = build(dropout=True)
    x, y = data()
    plateau = keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0)
    stopping = keras.callbacks.EarlyStopping("loss", patience=5)
    callbacks = [
        kd.DistributeCallback(kd.DataParallel()),
        kd.Checkpoint(
            directory, save_freq=2, save_on_background=background, **checkpoint_options
        ),
        plateau,
        stopping,
    ]
    if interrupt_at is not None:
        callbacks.append(_Interrupt(interrupt_at))
    keras.utils.set_random_seed(7)
    try:
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=3,
            shuffle=True,
            verbose=0,
            callbacks=callbacks,
        )
    except KeyboardInterrupt:
        return model, None, plateau, stopping
    return model, history.history, plateau, stopping


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    model, history, plateau, stopping = _fit(directory / "ck")
    return {
        "weights": model.get_weights(),
        "history": history,
        "plateau": (plateau.best, plateau.wait, plateau.cooldown_counter),
        "stopping": (stopping.best, stopping.wait),
        "learning_rate": float(
            keras.ops.convert_to_numpy(model.optimizer.learning_rate)
        ),
        "directory": directory / "ck",
    }


def _assert_weights_equal(got: list, expected: list, atol: float = 1e-6) -> None:
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)


# TensorFlow: background only (a TensorFlow fit on 8 simulated devices takes
# 15 to 30 s on 2 busy cores; blocking saves are in its engine's tests).
MODES = [True] if BACKEND == "tensorflow" else [True, False]


@pytest.mark.parametrize(
    "background", MODES, ids=["background", "blocking"][: len(MODES)]
)
def test_a_fit_cut_mid_epoch_resumes_exactly(uninterrupted, tmp_path, background):
    directory = tmp_path / "ck"
    # 6 batches an epoch, save_freq=2: cut as epoch 1 ends, before its
    # epoch-end save; the latest complete checkpoint is step 10 (epoch 1,
    # batch 4), mid-epoch.
    _fit(directory, interrupt_at=1, background=background)
    # A background save goes on after the call raised, and commits once
    # written.
    assert wait_until(lambda: store.latest_step(str(directory)) == 10, timeout=60)
    keras.utils.set_random_seed(123)  # the resume does not depend on it
    model, history, plateau, stopping = _fit(directory, background=background)

    _assert_weights_equal(model.get_weights(), uninterrupted["weights"])
    # The resumed epochs' logs (epoch 1 from its batch 2 on) are the same.
    for key, values in uninterrupted["history"].items():
        np.testing.assert_allclose(history[key], values[1:], atol=1e-6, err_msg=key)
    assert (plateau.best, plateau.wait, plateau.cooldown_counter) == pytest.approx(
        uninterrupted["plateau"]
    )
    assert (stopping.best, stopping.wait) == pytest.approx(uninterrupted["stopping"])
    learning_rate = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    assert learning_rate == pytest.approx(uninterrupted["learning_rate"])


def test_checkpoints_are_committed_whole_and_pruned(uninterrupted, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(uninterrupted["directory"], directory)
    names = sorted(os.listdir(directory))
    # max_to_keep=3 (the default) of 9 saves (every 2 of 18 steps).
    assert names == ["step-000000014", "step-000000016", "step-000000018"]
    manifest = json.loads((directory / names[-1] / store.MANIFEST).read_text())
    assert manifest["step"] == 18 and manifest["position"]["epoch"] == 3
    for name, size in manifest["files"].items():
        assert (directory / names[-1] / name).stat().st_size == size
    # An unfinished save (no manifest) and a step with a file cut short are
    # never picked, by a resume or by kd.restore.
    shutil.copytree(directory / names[-1], directory / ".tmp-step-000000020")
    (directory / ".tmp-step-000000020" / store.MANIFEST).unlink()
    torn = directory / "step-000000022"
    shutil.copytree(directory / names[-1], torn)
    (torn / store.MANIFEST).write_text(
        json.dumps({**manifest, "step": 22}).replace('"step": 18', '"step": 22')
    )
    largest = max(manifest["files"], key=manifest["files"].get)
    with open(torn / largest, "r+b") as handle:
        handle.truncate(1)
    assert store.complete_steps(str(directory)) == [14, 16, 18]
    model = build(dropout=True)
    # The torn step 22 is passed over with a warning naming it and its file.
    with pytest.warns(RuntimeWarning, match="restoring step 18 instead") as warned:
        assert kd.restore(model, directory) == 18
    assert str(torn / largest) in str(warned[0].message)
    with pytest.raises(ValueError, match="not a complete keras_dist checkpoint"):
        kd.restore(build(dropout=True), directory, step=22)


def test_restore_gives_a_fresh_model_the_saved_predictions(uninterrupted):
    model = build(dropout=True)
    step = kd.restore(model, uninterrupted["directory"])
    assert step == 18
    _assert_weights_equal(model.get_weights(), uninterrupted["weights"])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 18


def test_restore_takes_a_directory_relative_to_the_working_directory(
    uninterrupted, monkeypatch
):
    # kd.Checkpoint takes relative directories; so does kd.restore (Orbax, on
    # JAX, reads absolute paths only).
    directory = pathlib.Path(uninterrupted["directory"])
    monkeypatch.chdir(directory.parent)
    model = build(dropout=True)
    assert kd.restore(model, directory.name) == 18
    _assert_weights_equal(model.get_weights(), uninterrupted["weights"])
    with pytest.raises(TypeError, match="directory=3"):
        kd.restore(model, 3)


def test_restore_names_what_does_not_match(uninterrupted, tmp_path):
    wider = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(9, name="hidden"), keras.layers.Dense(1)]
    )
    wider.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        kd.restore(wider, uninterrupted["directory"])
    with pytest.raises(ValueError, match="holds no complete keras_dist checkpoint"):
        kd.restore(build(), tmp_path)
    with pytest.raises(ValueError, match="has no checkpoint of step 5"):
        kd.restore(build(), uninterrupted["directory"], step=5)
    with pytest.raises(TypeError, match="needs a keras.Model"):
        kd.restore("model", uninterrupted["directory"])
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="is not built"):
        kd.restore(unbuilt, uninterrupted["directory"])


def test_save_best_only_saves_when_the_monitored_value_improves(tmp_path):
    directory = tmp_path / "ck"
    model = build(dropout=False)
    x, y = data()
    losses = []

    class Losses(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            losses.append(logs["loss"])

    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=4,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(
                directory, monitor="loss", save_best_only=True, max_to_keep=None
            ),
            Losses(),
        ],
    )
    improved = [i for i, loss in enumerate(losses) if loss == min(losses[: i + 1])]
    assert store.complete_steps(str(directory)) == [6 * (i + 1) for i in improved]


@pytest.mark.backend("torch")  # the callback's own logic, the same everywhere
def test_save_best_only_with_a_step_frequency_checks_every_save_freq_steps(tmp_path):
    """As Keras' ModelCheckpoint: a check every `save_freq` steps, whether or
    not it saved; a check that finds no improvement is not retried at the
    next step."""
    directory = tmp_path / "ck"
    model = build(dropout=False)
    x, y = data()
    # The monitored value after each global step (1-based); checks at 2, 4, 6.
    score = {1: 9.0, 2: 5.0, 3: 9.0, 4: 6.0, 5: 4.0, 6: 3.0}

    class Score(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            logs["score"] = score.get(self.step, 99.0)

        def on_epoch_end(self, epoch, logs=None):
            logs["score"] = 99.0

    model.fit(
        np.concatenate([x, x])[:80],  # 10 batches: the checks are mid-epoch
        np.concatenate([y, y])[:80],
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            Score(),
            kd.Checkpoint(
                directory,
                save_freq=2,
                monitor="score",
                mode="min",
                save_best_only=True,
                max_to_keep=None,
            ),
        ],
    )
    # Step 4 (6.0) does not improve on 5.0; step 5 (4.0) is not a check.
    assert store.complete_steps(str(directory)) == [2, 6]


def test_export_writes_one_file_plain_keras_loads(uninterrupted, tmp_path):
    model = build(dropout=True)
    kd.restore(model, uninterrupted["directory"])
    path = kd.export(model, tmp_path / "model.keras")
    loaded = keras.saving.load_model(path)
    x, _ = data()
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    kd.export(model, tmp_path / "model.weights.h5")
    fresh = build(dropout=True)
    fresh.load_weights(tmp_path / "model.weights.h5")
    _assert_weights_equal(fresh.get_weights(), model.get_weights(), atol=0)
    with pytest.raises(ValueError, match=r"\.keras"):
        kd.export(model, tmp_path / "model.h5")


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"save_freq": 0}, "save_freq"),
        ({"save_freq": "batch"}, "save_freq"),
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"mode": "lowest"}, "mode"),
        ({"save_best_only": True}, "monitor"),
        ({"save_on_background": "yes"}, "save_on_background"),
    ],
)
def test_checkpoint_rejects_bad_arguments_naming_them(options, error, tmp_path):
    with pytest.raises((ValueError, TypeError), match=error):
        kd.Checkpoint(tmp_path, **options)


@pytest.mark.parametrize(
    "background", MODES, ids=["background", "blocking"][: len(MODES)]
)
def test_the_state_fit_ends_with_is_saved_and_a_second_fit_trains_nothing(
    tmp_path, background
):
    """26 steps with save_freq=10: saves at 10 and 20, and at the end of `fit`
    (step 26), committed before `fit` returns."""
    directory = tmp_path / "ck"
    x, y = data()
    x, y = np.resize(x, (26 * BATCH, x.shape[1])), np.resize(y, (26 * BATCH, 1))

    class Steps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

    def fit():
        model, steps = build(dropout=True), Steps()
        keras.utils.set_random_seed(3)
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=True,
            verbose=0,
            callbacks=[
                kd.DistributeCallback(kd.DataParallel()),
                kd.Checkpoint(
                    directory,
                    save_freq=10,
                    max_to_keep=None,
                    save_on_background=background,
                ),
                steps,
            ],
        )
        return model, steps.steps

    model, steps = fit()
    assert steps == 26
    # No waiting: the last save is committed once fit returned.
    assert store.complete_steps(str(directory)) == [10, 20, 26]
    restored = build(dropout=True)
    assert kd.restore(restored, directory) == 26
    _assert_weights_equal(restored.get_weights(), model.get_weights(), atol=0)
    again, steps = fit()
    assert steps == 0
    assert int(keras.ops.convert_to_numpy(again.optimizer.iterations)) == 26
    _assert_weights_equal(again.get_weights(), model.get_weights(), atol=0)
    assert store.complete_steps(str(directory)) == [10, 20, 26]
