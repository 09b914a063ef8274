"""Keras' callbacks: quiet ones, one writer for `BackupAndRestore`, and the
`CallbackList` a callback belongs to."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import keras

# Callbacks that only write files; in a multi-process job only process 0 runs
# them. (ModelCheckpoint is not among them: reading arrays that span processes
# is collective, so every process must save; see `keras_dist.saving`.)
FILE_WRITING_CALLBACKS = (
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
)


def _do_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def silence_callbacks(
    classes: tuple[type, ...], also: tuple[str, ...] = ()
) -> Callable[[], None]:
    """Make every callback of `classes` do nothing in this process (its `on_*`
    methods and the methods named in `also`); return the function that
    restores them.

    Called on processes other than 0 for the duration of a distributed call, so
    progress, logs and checkpoints of replicated state appear once. Patching the
    classes rather than a setting also covers the hooks Keras runs on its
    callback threads, where thread-local settings do not reach.
    """
    saved: list[tuple[type, str, Any]] = []
    for cls in classes:
        for name in dir(cls):
            if (name.startswith("on_") or name in also) and callable(
                getattr(cls, name)
            ):
                saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _do_nothing)

    def restore() -> None:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)

    return restore


def one_writer_backup_and_restore(
    is_writer: Callable[[], bool], barrier: Callable[[str], None]
) -> None:
    """Make `keras.callbacks.BackupAndRestore` write and delete its backup on
    the writer process only, the others waiting at `barrier` until it is done
    (idempotent).

    Every process still reads the backup when training starts (the directory
    must be one they all see) and still calls `save_weights` when the writer
    does, so that reads of variables spanning processes, which are collective,
    happen on all of them.
    """
    from keras.src.utils import file_utils  # noqa: PLC0415

    cls = keras.callbacks.BackupAndRestore
    if getattr(cls._save_model, "_keras_dist_wrapped", False):
        return
    save_backup, delete_backup = cls._save_model, cls.on_train_end

    def on_train_begin(self: Any, logs: Any = None) -> None:
        # Keras' own, with the repair of an unreadable backup from the previous
        # one done by the writer alone.
        try:
            self._load_model()
        except OSError:
            if not file_utils.exists(self._prev_weights_path):
                raise
            if is_writer():
                file_utils.copy(self._prev_weights_path, self._weights_path)
                if file_utils.exists(self._prev_training_metadata_path):
                    file_utils.copy(
                        self._prev_training_metadata_path,
                        self._training_metadata_path,
                    )
                elif file_utils.exists(self._training_metadata_path):
                    file_utils.remove(self._training_metadata_path)
            barrier(f"BackupAndRestore repair {self.backup_dir}")
            self._load_model()

    def _save_model(self: Any) -> None:
        if is_writer():
            save_backup(self)
        else:
            self.model.save_weights(self._weights_path, overwrite=True)
        barrier(f"BackupAndRestore save {self.backup_dir}")

    def on_train_end(self: Any, logs: Any = None) -> None:
        if is_writer():
            delete_backup(self, logs)
        barrier(f"BackupAndRestore delete {self.backup_dir}")

    for function in (on_train_begin, _save_model, on_train_end):
        function._keras_dist_wrapped = True  # type: ignore[attr-defined]
        setattr(cls, function.__name__, function)


def calling_callback_list() -> Any:
    """The `CallbackList` whose `set_model` is calling the caller's
    `set_model` (Keras gives a callback no handle on its siblings), or None."""
    frame = sys._getframe(2)
    for _ in range(6):  # a subclass' set_model may call super()'s
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.callbacks.CallbackList):
            return candidate
        frame = frame.f_back
    return None


def check() -> list[str]:
    """What `one_writer_backup_and_restore` and `calling_callback_list` need."""
    import inspect  # noqa: PLC0415

    missing = []
    backup = keras.callbacks.BackupAndRestore("probe")
    for name in (
        "_load_model",
        "_save_model",
        "_weights_path",
        "_prev_weights_path",
        "_training_metadata_path",
        "_prev_training_metadata_path",
    ):
        if not hasattr(backup, name):
            missing.append(f"BackupAndRestore.{name}")
    if "callback.set_model(model)" not in inspect.getsource(
        keras.callbacks.CallbackList.set_model
    ):
        missing.append("CallbackList.set_model calls each callback's set_model")
    return missing
