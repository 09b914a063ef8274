"""One writer in a multi-process job: process 0 writes every file.

Users call `model.save(...)`, `model.save_weights(...)` and
`keras.saving.save_model(...)` on every process, inside a call (ModelCheckpoint)
or after it; Keras' `BackupAndRestore`, `TensorBoard` and `CSVLogger` run on
every process too. Each process writing the same file corrupts it. Once a job
has more than one process (`keras_dist.initialize()` or the first distributed
call installs this), then:

- a save writes on process 0 only, to a temporary name in the same directory
  that replaces the file once complete (a killed writer never leaves a
  truncated file under the real name; the next save removes the temporary
  files of writers killed outright). The other processes read every variable
  as process 0 does (reading arrays that span processes is collective) into a
  scratch file they delete, then wait until process 0's file is complete, so
  any process can load it on the next line. On JAX and PyTorch process 0 does
  not wait for them, so a save made on process 0 alone works too, unless a
  variable is split across processes (model parallelism: reading it is
  collective, every process must save); on TensorFlow all processes meet at
  a barrier;
- `BackupAndRestore` writes and deletes its backup on process 0 only, the
  others waiting for it; every process reads the backup when training starts,
  so its directory must be one they all see (a shared file system on several
  hosts, as for Keras' own `OrbaxCheckpoint`);
- `TensorBoard` and `CSVLogger` do nothing on the other processes.

The waits time out after `KERAS_DIST_INIT_TIMEOUT` seconds (300 by default)
with an error naming the process that waited.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.faults import heartbeat
from keras_dist.faults.lifecycle import is_alive, removed_if_stopped
from keras_dist.keras_compat.callbacks import (
    FILE_WRITING_CALLBACKS,
    one_writer_backup_and_restore,
    silence_callbacks,
)
from keras_dist.keras_compat.saving import (
    tolerate_existing_directories,
    wrap_saving_functions,
)

_installed: list[bool] = []


def install() -> None:
    """Process 0 writes, from now on, if this job has several processes
    (idempotent; nothing for one process)."""
    adapter = get_adapter()
    if _installed or adapter.num_processes() == 1:
        return
    _installed.append(True)
    wrap_saving_functions(_process_zero_writes)
    one_writer_backup_and_restore(is_writer=_is_writer, barrier=barrier)
    # Every process' ModelCheckpoint creates a missing directory at once.
    tolerate_existing_directories()
    if adapter.process_id() != 0:
        # `set_model` too: TensorBoard writes the model's summary there.
        silence_callbacks(FILE_WRITING_CALLBACKS, also=("set_model",))


def _is_writer() -> bool:
    return get_adapter().process_id() == 0


def barrier(name: str) -> None:
    """Wait until every process of the job has reached `barrier(name)`."""
    get_adapter().barrier(name, timeout_seconds=job.timeout_seconds())


_waits: dict[str, int] = {}


def _wait_for_writer(name: str) -> None:
    """Wait until process 0 got past `name` (it does not wait itself, so a
    save made on process 0 alone never blocks)."""
    count = _waits[name] = _waits.get(name, 0) + 1
    get_adapter().wait_for_process_zero(
        f"{name}#{count}", timeout_seconds=job.timeout_seconds()
    )


def _process_zero_writes(save: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(save)

    @functools.wraps(save)
    def one_writer(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        if get_adapter().num_processes() == 1:
            return save(model, filepath, *args, **kwargs)
        with heartbeat.phase("save"):  # what the hang doctor reports
            if _is_writer():
                options = signature.bind(model, filepath, *args, **kwargs).arguments
                result = _write_whole(save, model, filepath, options, args, kwargs)
            else:
                result = _read_without_keeping(save, model, filepath, args, kwargs)
            # Numbered, not named by the path: processes may save under names of
            # their own (`model-{rank}.keras`), which process 0 alone writes.
            _wait_for_writer("save")
        return result

    return one_writer


def _write_whole(
    save: Callable[..., Any],
    model: Any,
    filepath: Any,
    options: dict[str, Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """`save` to a temporary name next to `filepath`, then renamed to it."""
    temporary = _temporary_name(filepath, options)
    if temporary is None:
        return save(model, filepath, *args, **kwargs)
    remove_stale_temporaries(os.path.dirname(temporary))
    try:
        # A signal ends the process without unwinding this block.
        with removed_if_stopped(temporary):
            result = save(model, temporary, *args, **kwargs)
            os.replace(temporary, os.fspath(filepath))
    finally:
        if os.path.isfile(temporary):
            os.remove(temporary)
    return result


_TEMPORARY = re.compile(r"\.keras_dist-(\d+)-.")


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files (`.keras_dist-<pid>-<name>`) in `directory`
    left by writers that no longer run (killed outright mid-save); returns
    their paths. Those of processes running on this machine stay."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory or "."):
            match = _TEMPORARY.match(name)
            if match is None or is_alive(int(match.group(1))):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                os.remove(path)
                removed.append(path)
    return removed


def _temporary_name(filepath: Any, options: dict[str, Any]) -> str | None:
    """Where to write `filepath` first, or None to write it in place: a
    directory (`zipped=False`, sharded weights), a remote path, or a file
    that must not be overwritten (Keras asks the user)."""
    if not isinstance(filepath, str | os.PathLike):
        return None
    path = os.fspath(filepath)
    if (
        "://" in path
        or options.get("zipped") is False
        or options.get("max_shard_size") is not None
        or (not options.get("overwrite", True) and os.path.exists(path))
    ):
        return None
    directory, name = os.path.split(path)
    # The name keeps its ending: Keras picks the format from it.
    return os.path.join(directory, f".keras_dist-{os.getpid()}-{name}")


def _read_without_keeping(
    save: Callable[..., Any], model: Any, filepath: Any, args: tuple, kwargs: dict
) -> Any:
    with tempfile.TemporaryDirectory(prefix="keras_dist_scratch_") as scratch:
        name = os.path.basename(str(filepath).rstrip("/")) or "model.keras"
        return save(model, os.path.join(scratch, name), *args, **kwargs)


# A job joined through `keras_dist.initialize()` writes with one writer from
# then on, inside a distributed call or not.
job.when_joined(install)
