"""TensorFlow's checkpoint engine: `tf.train.Checkpoint` `write` and `read`.

A checkpoint is TensorFlow's own tensor bundle, `<directory>/ckpt.index` and
`ckpt.data-*-of-*`, of one dict `state` whose keys are keras_dist's
structural keys: `layers/dense/vars/0` is stored as
`state/layers.Sdense.Svars.S0/.ATTRIBUTES/VARIABLE_VALUE` (TensorFlow escapes
`.` and `/` in names). TensorFlow writes the `.index` file last, after merging
the data files; a directory without it is a save that did not finish.

The variables saved are the TensorFlow variables behind the Keras ones. Under
`kd.DataParallel` they are `MirroredVariable`s (one value per replica, equal:
written once) and, for metric states and gradient accumulators,
`SyncOnReadVariable`s: TensorFlow writes their sum over every replica of every
process and divides it among the replicas again on restore, whatever their
number, so the global metric state and a partial gradient sum survive a change
of device or process count.

Multi-worker (`MultiWorkerMirroredStrategy`): reading a `SyncOnReadVariable`
is an all-reduce, so every worker writes, TensorFlow's own pattern
(`distributed_file_utils`): process 0 into the checkpoint directory, the
others into a temporary directory of their own, removed once written.
Everything is replicated on TensorFlow (keras_dist refuses `ModelParallel`
there), so process 0's files hold the whole state.

`background=True` is TensorFlow's asynchronous checkpointing
(`CheckpointOptions(enable_async=True)`): `write` copies the variables to host
memory and returns; a TensorFlow thread writes the copy.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from typing import Any

from keras_dist.common import job

ENGINE = "tf.train.Checkpoint"
# The file prefix inside a step directory: ckpt.index, ckpt.data-00000-of-00001.
PREFIX = "ckpt"
_DATA_FILE = re.compile(re.escape(PREFIX) + r"\.data-(\d{5})-of-(\d{5})$")
# The last save's checkpoint object (its traced save function and, once a
# background save ran, TensorFlow's writer thread and host copies), reused
# while the same variables are saved.
_cache: dict[str, Any] = {"variables": None, "checkpoint": None, "pending": None}


def native_name(key: str) -> str:
    """The name TensorFlow gives `key`'s value inside the checkpoint."""
    escaped = key.replace(".", "..").replace("/", ".S")
    return f"state/{escaped}/.ATTRIBUTES/VARIABLE_VALUE"


# -- saving ----------------------------------------------------------------------
class _Written:
    """A save whose files were complete when `save` returned."""

    def wait(self, timeout_seconds: float) -> None:
        return None

    def done(self) -> bool:
        return True


class _Background:
    """A save that TensorFlow's writer thread is finishing."""

    def __init__(self, checkpoint: Any, prefix: str, rank: int, scratch: str | None):
        self._checkpoint = checkpoint
        self._prefix = prefix
        self._rank = rank
        self._scratch = scratch
        self._written = threading.Event()
        self._ended = threading.Event()
        self._error: BaseException | None = None
        # Whether a `wait` raised this save's failure (reported once).
        self.failure_reported = False

    def on_written(self, path: str) -> None:
        """TensorFlow's write callback, called on its thread once the files
        are complete (never when the write failed)."""
        self.remove_scratch()
        self._written.set()

    def watch(self) -> None:
        """Note when TensorFlow's writer thread is idle again, written or
        failed (`sync` has no timeout, so it runs on a thread of its own)."""

        def ended() -> None:
            try:
                self._checkpoint.sync()
            finally:
                self._ended.set()

        threading.Thread(
            target=ended, name=f"keras_dist-tf-checkpoint-{self._prefix}", daemon=True
        ).start()

    def done(self) -> bool:
        return self._written.is_set() or self._ended.is_set()

    def wait(self, timeout_seconds: float) -> None:
        if self._written.is_set():
            return
        if not self._ended.wait(timeout_seconds):
            raise RuntimeError(
                f"Process {self._rank}: TensorFlow's background checkpoint write "
                f"to {self._prefix} did not finish within {timeout_seconds} s. "
                "Is the file system slow or full?"
            )
        if self._written.is_set():
            return
        from keras_dist.backends.tensorflow import keras_internals  # noqa: PLC0415

        self.remove_scratch()
        if self._error is None:
            self._error = keras_internals.take_async_write_error(self._checkpoint)
        self.failure_reported = True
        why = f"{type(self._error).__name__}: {self._error}" if self._error else "?"
        raise RuntimeError(
            f"Process {self._rank}: TensorFlow's background checkpoint write to "
            f"{self._prefix} failed ({why}). The checkpoint is incomplete and "
            "will not be restored from."
        ) from self._error

    def remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _tf_variables(state: dict[str, Any], what: str) -> dict[str, Any]:
    """The TensorFlow variable behind each Keras variable of `state`."""
    import keras  # noqa: PLC0415

    from keras_dist.backends.tensorflow import keras_internals  # noqa: PLC0415

    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"The {ENGINE} engine {what}s the variables of a TensorFlow model; "
            f"this process runs KERAS_BACKEND={keras.backend.backend()!r}. Use "
            "`keras_dist.restore`, which reads a TensorFlow checkpoint on any "
            "backend."
        )
    if not isinstance(state, dict) or not state:
        raise TypeError(
            f"`state` must be a non-empty dict of Keras variables by key; "
            f"received {type(state).__name__} {state!r:.200}."
        )
    variables = {}
    for key, variable in state.items():
        if not isinstance(key, str) or not isinstance(variable, keras.Variable):
            raise TypeError(
                f"`state` must map str keys to Keras variables; received "
                f"{key!r}: {type(variable).__name__}."
            )
        variables[key] = keras_internals.tf_variable(variable)
    return variables


def _checkpoint_for(variables: dict[str, Any]) -> Any:
    """A `tf.train.Checkpoint` of `variables`; the last one when they are the
    same variables (its save function is traced, its background writer
    started, once)."""
    import tensorflow as tf  # noqa: PLC0415

    from keras_dist.backends.tensorflow import keras_internals  # noqa: PLC0415

    signature = [(key, id(v)) for key, v in variables.items()]
    cached = _cache["variables"]
    if cached is not None and [(k, id(v)) for k, v in cached.items()] == signature:
        return _cache["checkpoint"]
    if _cache["checkpoint"] is not None:
        keras_internals.close_async_writer(_cache["checkpoint"])
    # The dict is copied: the checkpoint tracks its own.
    _cache["variables"] = dict(variables)
    _cache["checkpoint"] = tf.train.Checkpoint(state=dict(variables))
    return _cache["checkpoint"]


def save(directory: str | os.PathLike, state: dict[str, Any], *, background: bool):
    """Write `state` into `directory` (see `keras_dist.checkpoint.engine`).

    Every process must call it with the same keys (multi-worker: the metric
    states are read with all-reduces). Process 0 writes `directory/ckpt.*`;
    the others write the same values into a temporary directory, removed once
    written.
    """
    import tensorflow as tf  # noqa: PLC0415

    variables = _tf_variables(state, "save")
    directory = os.fspath(directory)
    rank = job.process_id()
    if rank == 0 and not os.path.isdir(directory):
        raise ValueError(
            f"The checkpoint directory {directory!r} does not exist; process 0 "
            "creates it before every process saves."
        )
    previous, _cache["pending"] = _cache["pending"], None
    if previous is not None and not previous.failure_reported:
        # One save in flight: TensorFlow's writer holds one copy. A failure
        # its own wait did not report is reported here.
        previous.wait(job.timeout_seconds())
    checkpoint = _checkpoint_for(variables)
    checkpoint.sync()  # returns at once: the previous write has ended
    scratch = None
    if rank != 0:
        scratch = tempfile.mkdtemp(prefix=f"keras_dist-tf-checkpoint-rank{rank}-")
    prefix = os.path.join(scratch or directory, PREFIX)
    if not background:
        try:
            checkpoint.write(prefix)
        except tf.errors.OpError as error:
            raise RuntimeError(
                f"Process {rank}: TensorFlow could not write the checkpoint "
                f"{prefix} ({type(error).__name__}: {error.message})"
            ) from error
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return _Written()
    pending = _Background(checkpoint, prefix, rank, scratch)
    options = tf.train.CheckpointOptions(
        enable_async=True, experimental_write_callbacks=[pending.on_written]
    )
    try:
        checkpoint.write(prefix, options=options)
    except Exception as error:  # TF's copy, or its previous write's error
        pending.remove_scratch()
        raise RuntimeError(
            f"Process {rank}: TensorFlow could not start writing the checkpoint "
            f"{prefix} ({type(error).__name__}: {error})"
        ) from error
    pending.watch()
    _cache["pending"] = pending
    return pending


# -- reading ---------------------------------------------------------------------
def _complete_prefix(directory: str | os.PathLike) -> str:
    """`directory`'s checkpoint prefix; a ValueError when the directory does
    not hold a complete checkpoint (a save that did not finish)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(
            f"No checkpoint directory at {directory!r}. Pass a step directory "
            "that `keras_dist.Checkpoint` committed."
        )
    names = os.listdir(directory)
    if f"{PREFIX}.index" not in names:
        raise ValueError(
            f"{directory!r} holds no complete {ENGINE} checkpoint: "
            f"{PREFIX}.index is missing. TensorFlow writes it last, so the save "
            f"that wrote this directory did not finish (found: {sorted(names)}). "
            "Restore from an earlier step."
        )
    shards = [_DATA_FILE.match(name) for name in names]
    shards = [(int(m.group(1)), int(m.group(2))) for m in shards if m]
    counts = {count for _, count in shards}
    if len(counts) != 1 or {i for i, _ in shards} != set(range(counts.pop())):
        raise ValueError(
            f"{directory!r} holds an incomplete {ENGINE} checkpoint: its data "
            f"files {PREFIX}.data-NNNNN-of-NNNNN are missing or mixed "
            f"(found: {sorted(names)}). Restore from an earlier step."
        )
    return os.path.join(directory, PREFIX)


def _read_errors(tf: Any) -> tuple[type[BaseException], ...]:
    """What TensorFlow raises on damaged checkpoint files: an `OpError`
    (`DataLossError`...), or from its C++ reader an `IndexError` ("Read less
    bytes than requested") or a `RuntimeError`."""
    return (tf.errors.OpError, IndexError, RuntimeError)


def _reader(tf: Any, prefix: str) -> Any:
    """TensorFlow's reader of the checkpoint at `prefix` (it reads the index
    file): a `ValueError` naming that file when it is damaged."""
    try:
        return tf.train.load_checkpoint(prefix)
    except _read_errors(tf) as error:
        raise _damaged(prefix, [f"{prefix}.index"], error) from error


def _data_files(prefix: str) -> list[str]:
    directory = os.path.dirname(prefix)
    return sorted(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if _DATA_FILE.match(name)
    )


def _damaged(prefix: str, files: list[str], error: BaseException) -> ValueError:
    where = f"its file {files[0]}" if len(files) == 1 else f"one of its files {files}"
    return ValueError(
        f"TensorFlow could not read the checkpoint {prefix}: {where} is damaged or "
        "incomplete "
        f"({type(error).__name__}: {error}). Restore from an earlier step."
    )


def _check_entries(
    directory: Any, saved: dict[str, list[int]], entries: dict[str, Any]
) -> None:
    missing = sorted(key for key in entries if native_name(key) not in saved)
    if missing:
        raise ValueError(
            f"The checkpoint in {os.fspath(directory)!r} has no value for "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} of {len(entries)} keys). Was it written for "
            "another model?"
        )
    for key, entry in entries.items():
        expected = [int(d) for d in entry["shape"]]
        if list(saved[native_name(key)]) != expected:
            raise ValueError(
                f"The checkpoint in {os.fspath(directory)!r} holds {key!r} with "
                f"shape {list(saved[native_name(key)])}, its manifest says "
                f"{expected}. The checkpoint files do not belong together."
            )


def read_arrays(
    directory: str | os.PathLike, entries: dict[str, Any]
) -> dict[str, Any]:
    """The full value of each key of `entries`, as NumPy arrays, in one process,
    whatever Keras backend runs (only TensorFlow is imported)."""
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    prefix = _complete_prefix(directory)
    reader = _reader(tf, prefix)
    try:
        _check_entries(directory, reader.get_variable_to_shape_map(), entries)
        arrays = {
            key: np.asarray(reader.get_tensor(native_name(key))) for key in entries
        }
    except _read_errors(tf) as error:
        raise _damaged(prefix, _data_files(prefix), error) from error
    for key, array in arrays.items():
        dtype = str(entries[key]["dtype"])
        if str(array.dtype) != dtype:
            raise ValueError(
                f"The checkpoint {prefix} holds {key!r} as {array.dtype}, its "
                f"manifest says {dtype}. The checkpoint files do not belong "
                "together."
            )
    return arrays


def load(
    directory: str | os.PathLike, state: dict[str, Any], entries: dict[str, Any]
) -> None:
    """Restore every variable of `state` from `directory`, in place, laid out
    the variable's current way (mirrored on every replica, metric sums divided
    among the replicas). Every process reads the whole (replicated) state."""
    import tensorflow as tf  # noqa: PLC0415

    variables = _tf_variables(state, "load")
    unknown = sorted(set(variables) - set(entries))
    if unknown:
        raise ValueError(
            f"The checkpoint's manifest lists no {unknown[:8]}; received a state "
            "with keys the checkpoint does not have."
        )
    prefix = _complete_prefix(directory)
    saved = _reader(tf, prefix).get_variable_to_shape_map()
    try:
        _check_entries(directory, saved, {key: entries[key] for key in variables})
        for key, variable in variables.items():
            if list(saved[native_name(key)]) != list(variable.shape):
                raise ValueError(
                    f"The checkpoint {prefix} holds {key!r} with shape "
                    f"{list(saved[native_name(key)])}, but the model's variable "
                    f"has shape {list(variable.shape)}. Restore into the model "
                    "that was saved (same layers and sizes)."
                )
        status = tf.train.Checkpoint(state=dict(variables)).read(prefix)
        status.assert_existing_objects_matched()
        status.expect_partial()
    except _read_errors(tf) as error:
        raise _damaged(prefix, _data_files(prefix), error) from error


def assign_arrays(state: dict[str, Any], arrays: dict[str, Any]) -> None:
    """Give each variable of `state` its full value from `arrays` (a restore
    from another engine's checkpoint). A mirrored variable gets it on every
    replica; a metric state or gradient accumulator (`SyncOnRead`, summed) is
    divided among the replicas of every process, so that their sum is the
    value."""
    import numpy as np  # noqa: PLC0415

    _tf_variables(state, "assign")
    missing = sorted(set(state) - set(arrays))
    if missing:
        raise ValueError(
            f"No value for {missing[:8]} ({len(missing)} of {len(state)} keys) in "
            "the arrays read from the checkpoint. Was it written for another model?"
        )
    for key, variable in state.items():
        value = np.asarray(arrays[key])
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"The checkpoint holds {key!r} with shape {list(value.shape)}, but "
                f"the model's variable has shape {list(variable.shape)}. Restore "
                "into the model that was saved (same layers and sizes)."
            )
        variable.assign(value)
