"""A damaged checkpoint is never skipped without a word (issue 25).

On every backend (JAX and TensorFlow on 8 simulated devices, PyTorch in one
process): the newest checkpoint of a fit is damaged four ways (a data file cut
short, a manifest that does not parse, the engine's metadata garbled, a data
file garbled, each of the same size as before but the first), and a resume or
`kd.restore` warns naming the damaged step, the file and the reason, and the
step taken instead; `on_damaged="raise"` stops with a `DamagedCheckpointError`
naming them, before any training.
"""

from __future__ import annotations

import json
import shutil

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store
from tests.conftest import BACKEND

ROWS, BATCH, SAVE_FREQ = 96, 8, 4  # 12 steps: checkpoints of steps 4, 8, 12
NEWEST, PREVIOUS = 12, 8
# Each engine's metadata file, and (a prefix of) its data files.
METADATA = {"jax": "orbax/_METADATA", "torch": ".metadata", "tensorflow": "ckpt.index"}
DATA = {"jax": "orbax/d/", "torch": "__0_0.distcp", "tensorflow": "ckpt.data-"}


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)],
        name="damaged",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class _Steps(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _fit(directory, **checkpoint_options) -> tuple[keras.Model, int]:
    model, steps = _model(), _Steps()
    x = np.random.default_rng(0).normal(size=(ROWS, 4)).astype("float32")
    model.fit(
        x,
        x.sum(axis=1, keepdims=True),
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(
                directory, save_freq=SAVE_FREQ, max_to_keep=None, **checkpoint_options
            ),
            steps,
        ],
    )
    return model, steps.steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved") / "ck"
    _, steps = _fit(directory)
    assert steps == NEWEST
    assert store.complete_steps(str(directory)) == [4, PREVIOUS, NEWEST]
    return directory


def _largest(step_path, prefix: str) -> str:
    manifest = json.loads((step_path / store.MANIFEST).read_text())
    names = [name for name in manifest["files"] if name.startswith(prefix)]
    assert names, (prefix, sorted(manifest["files"]))
    return max(names, key=manifest["files"].get)


def _garble(path) -> None:
    """The same number of bytes, none of them right."""
    size = path.stat().st_size
    path.write_bytes(bytes((i * 151 + 7) % 256 for i in range(size)))


DAMAGE = ["data file cut short", "manifest", "engine metadata", "data file garbled"]


def _damaged_copy(saved, tmp_path, damage: str):
    """A copy of the checkpoints whose newest is damaged; returns the copy
    and the damaged file."""
    directory = tmp_path / "ck"
    shutil.copytree(saved, directory)
    step_path = directory / f"step-{NEWEST:09d}"
    if damage == "data file cut short":
        file = step_path / _largest(step_path, DATA[BACKEND])
        with open(file, "r+b") as handle:
            handle.truncate(file.stat().st_size // 2)
    elif damage == "manifest":
        file = step_path / store.MANIFEST
        text = file.read_bytes()
        middle = len(text) // 2
        file.write_bytes(text[:middle] + b"\xff\xfe{" + text[middle + 3 :])
    elif damage == "engine metadata":
        file = step_path / METADATA[BACKEND]
        _garble(file)
    else:
        file = step_path / _largest(step_path, DATA[BACKEND])
        _garble(file)
    return directory, step_path, str(file)


@pytest.mark.parametrize("damage", DAMAGE)
def test_restore_warns_naming_the_damaged_step_and_file(saved, tmp_path, damage):
    directory, step_path, file = _damaged_copy(saved, tmp_path, damage)
    with pytest.warns(RuntimeWarning, match="damaged") as warned:
        assert kd.restore(_model(), directory) == PREVIOUS
    (message,) = [str(w.message) for w in warned if "damaged" in str(w.message)]
    assert f"step {NEWEST} ({step_path})" in message, message
    assert file in message, message
    assert f"restoring step {PREVIOUS} instead" in message, message
    assert "on_damaged='raise'" in message, message

    with pytest.raises(kd.checkpoint.DamagedCheckpointError) as raised:
        kd.restore(_model(), directory, on_damaged="raise")
    error = raised.value
    assert (error.step, error.path, error.file) == (NEWEST, str(step_path), file)
    assert file in str(error) and "Remove" in str(error)
    # The step asked for: always an error naming the file.
    with pytest.raises(kd.checkpoint.DamagedCheckpointError, match="damaged") as asked:
        kd.restore(_model(), directory, step=NEWEST)
    assert file in str(asked.value)


# A resume: a cut data file (found from the manifest) and a garbled one
# (found by the engine as it reads), on every backend.
@pytest.mark.parametrize("damage", ["data file cut short", "data file garbled"])
def test_a_resume_warns_and_goes_on_from_the_previous_step(
    saved, tmp_path, damage, capfd
):
    directory, step_path, file = _damaged_copy(saved, tmp_path, damage)
    with pytest.warns(RuntimeWarning, match="damaged") as warned:
        model, steps = _fit(directory)
    (message,) = [str(w.message) for w in warned if "damaged" in str(w.message)]
    assert message.startswith("kd.Checkpoint: 1 damaged checkpoint(s) skipped")
    assert f"step {NEWEST} ({step_path})" in message and file in message
    assert f"resuming from step {PREVIOUS} instead" in message
    err = capfd.readouterr().err
    assert f"resuming from {store.step_directory(str(directory), PREVIOUS)}" in err
    assert f"damaged checkpoint(s) of step {NEWEST} skipped" in err
    # Steps 9 to 12 again, saved again as step 12.
    assert steps == NEWEST - PREVIOUS
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == NEWEST
    assert store.complete_steps(str(directory)) == [4, PREVIOUS, NEWEST]


@pytest.mark.parametrize("damage", ["manifest", "engine metadata"])
def test_on_damaged_raise_stops_a_resume_before_training(saved, tmp_path, damage):
    directory, step_path, file = _damaged_copy(saved, tmp_path, damage)
    with open(file, "rb") as handle:
        damaged_bytes = handle.read()
    with pytest.raises(kd.checkpoint.DamagedCheckpointError) as raised:
        _fit(directory, on_damaged="raise")
    error = raised.value
    assert (error.step, error.file) == (NEWEST, file)
    assert str(error).startswith(f"kd.Checkpoint: The checkpoint of step {NEWEST}")
    assert "on_damaged='warn'" in str(error)
    # Nothing was trained or saved over it.
    with open(file, "rb") as handle:
        assert handle.read() == damaged_bytes
    assert sorted(p.name for p in directory.iterdir()) == [
        f"step-{step:09d}" for step in (4, PREVIOUS, NEWEST)
    ]


def test_on_damaged_takes_warn_or_raise(tmp_path):
    with pytest.raises(ValueError, match="Received: on_damaged='ignore'"):
        kd.Checkpoint(tmp_path, on_damaged="ignore")
    with pytest.raises(ValueError, match="Received: on_damaged=True"):
        kd.restore(_model(), tmp_path, on_damaged=True)


def test_restore_raises_when_no_checkpoint_reads(saved, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(saved, directory)
    for step in (4, PREVIOUS, NEWEST):
        _garble(directory / f"step-{step:09d}" / METADATA[BACKEND])
    with pytest.warns(RuntimeWarning, match="3 damaged checkpoint"):
        with pytest.raises(ValueError, match=r"steps \[4, 8, 12\] are all damaged"):
            kd.restore(_model(), directory)
