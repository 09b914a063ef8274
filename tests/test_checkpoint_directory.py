"""A `kd.Checkpoint` directory that cannot hold checkpoints is refused when the
callback is made or when `fit` starts, naming the path, the problem and the
fix: never a bare `OSError` at the first save, a whole epoch later (issue 25)."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store


class _Steps(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _fit(checkpoint: kd.Checkpoint) -> int:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 3), "float32")
    steps = _Steps()
    model.fit(
        x,
        x[:, :1],
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel()), checkpoint, steps],
    )
    return steps.steps


def test_a_directory_that_is_a_file_is_refused_when_made(tmp_path):
    path = tmp_path / "ck"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file, not a directory") as raised:
        kd.Checkpoint(path)
    assert str(path) in str(raised.value)
    assert "move the file away" in str(raised.value)


def test_a_directory_under_a_file_is_refused_when_made(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "sub" / "ck"
    with pytest.raises(ValueError, match="lies under") as raised:
        kd.Checkpoint(path)
    message = str(raised.value)
    assert str(path) in message and repr(str(tmp_path / "file")) in message
    assert not (tmp_path / "file").is_dir()


def test_a_missing_directory_is_created_when_fit_starts(tmp_path):
    path = tmp_path / "a" / "b" / "ck"
    checkpoint = kd.Checkpoint(path)
    assert not path.exists()  # making the callback creates nothing
    assert _fit(checkpoint) == 4
    assert store.complete_steps(str(path)) == [4]
    # The probe file is gone.
    assert sorted(os.listdir(path)) == ["step-000000004"]


@pytest.mark.backend("torch")  # the callback's own logic, the same everywhere
def test_a_directory_made_a_file_after_the_callback_is_refused_before_training(
    tmp_path,
):
    path = tmp_path / "ck"
    checkpoint = kd.Checkpoint(path)
    path.write_text("made since")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        _fit(checkpoint)


def _write_blocked(directory) -> bool:
    """Whether this user really cannot create a file in `directory` (root
    can, whatever its mode says)."""
    probe = os.path.join(directory, "probe")
    try:
        with open(probe, "w"):
            pass
    except PermissionError:
        return True
    os.remove(probe)
    return False


@pytest.mark.backend("torch")
def test_a_directory_this_process_cannot_write_is_refused_before_training(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    path.chmod(0o500)
    try:
        if not _write_blocked(path):
            pytest.skip(
                "this user writes into a read-only directory (root): the mode "
                "cannot block it; the next test blocks the write itself"
            )
        checkpoint = kd.Checkpoint(path)
        with pytest.raises(PermissionError, match="cannot write into") as raised:
            _fit(checkpoint)
        assert str(path) in str(raised.value)
    finally:
        path.chmod(0o700)


@pytest.mark.backend("torch")
def test_a_write_the_file_system_refuses_is_reported_before_training(
    tmp_path, monkeypatch
):
    """As root, a read-only directory is still writable: the file system's
    refusal is simulated where the probe creates its file."""
    path = tmp_path / "ck"
    real_open = os.open

    def refusing_open(name, flags, *args, **kwargs):
        if ".keras_dist-write-test" in os.fspath(name):
            raise PermissionError(13, "Permission denied", os.fspath(name))
        return real_open(name, flags, *args, **kwargs)

    checkpoint = kd.Checkpoint(path)
    monkeypatch.setattr(os, "open", refusing_open)
    steps = _Steps()
    with pytest.raises(PermissionError, match="process 0 cannot write into") as raised:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((16, 3), "float32")
        model.fit(
            x,
            x[:, :1],
            batch_size=4,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel()), checkpoint, steps],
        )
    message = str(raised.value)
    assert str(path) in message and "chmod" in message
    assert steps.steps == 0  # refused before the first step, not at a save


@pytest.mark.parametrize("url", ["gs://bucket/run", "s3://bucket/run"])
def test_a_url_is_refused_instead_of_a_local_directory_named_after_it(
    tmp_path, monkeypatch, url
):
    """Orbax alone could write to `gs://`, but a step directory is committed
    by renames and a manifest on the file system: a URL would be a local
    `gs:` directory, each host writing its own."""
    monkeypatch.chdir(tmp_path)
    scheme = url.split("://")[0]
    for make in (
        lambda: kd.Checkpoint(url),
        lambda: kd.restore(keras.Sequential([keras.Input((3,))]), url),
    ):
        with pytest.raises(
            ValueError, match=f"not a URL: '{url}' would be a local"
        ) as error:
            make()
        assert f"directory named '{scheme}:'" in str(error.value)
        assert "Cloud Storage FUSE" in str(error.value)
    assert not os.listdir(tmp_path)  # nothing was created
