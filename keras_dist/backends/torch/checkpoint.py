"""The PyTorch checkpoint engine: `torch.distributed.checkpoint` (DCP).

See `keras_dist.checkpoint.engine` for the interface. Every process saves
`{key: the tensor its Keras variable holds}` with DCP into the same directory:

- Under `ModelParallel` (`dtensor.ShardedRun`) a variable holds a DTensor, and
  each process writes only its own shard (`__<rank>_0.distcp`); a replicated
  value is written once (DCP's planner keeps one copy of equal keys).
- Under `DataParallel` (DDP) every variable is replicated: process 0 writes
  the one copy (as it does for the replicated values under DTensor, so that
  its value wins wherever processes differ). The metric states are the
  exception: each
  process keeps its own (`metric_sync` sums them into the
  results), so the checkpoint gets their global value (summed over processes),
  and a restore gives process 0 that sum and the other processes zeros, which
  sum to the same results on any number of processes.

The saves and loads coordinate through a process group of their own (gloo, made
once), so a save writing in the background never interleaves its collectives
with the training step's (DDP's, DTensor's) on the default group. One save is
in flight at a time. DCP writes `.metadata` last, only once every process has
written its files: a directory without it is an unfinished save.

DCP's files are pickles: load only checkpoints you trust.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

ENGINE = "torch.distributed.checkpoint"
_METADATA = ".metadata"
# How long a new save or a load waits for the previous background save.
_PREVIOUS_SAVE_SECONDS = 600.0

# [the default group, the checkpoint group]: held, so that a later job's
# default group is never taken for this one's.
_groups: list[Any] = [None, None]
_in_flight: list[Pending] = []


def _torch() -> tuple[Any, Any, Any]:
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            "keras_dist's PyTorch checkpoints are written with "
            f"torch.distributed.checkpoint, which cannot be imported ({error}). "
            "Install it with `pip install keras-dist[torch]`."
        ) from error
    return torch, dist, dcp


def _world() -> tuple[int, int]:
    _, dist, _ = _torch()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _group() -> Any:
    """The checkpoint's own gloo process group (collective the first time:
    every process saves and loads), or None in a one-process job."""
    _, dist, _ = _torch()
    world_size, _ = _world()
    if world_size == 1:
        return None
    default = dist.distributed_c10d._get_default_group()
    if _groups[0] is not default:
        _groups[:] = [default, dist.new_group(backend="gloo")]
    return _groups[1]


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group,
    which is what keras_dist asks for then (`no_dist=True`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _damaged_data(
    directory: Any, metadata: Any, error: BaseException
) -> ValueError | None:
    """A `ValueError` naming the data files and the reason when DCP's load
    failed on a damaged file (not on a lost process), else None."""
    import pickle  # noqa: PLC0415

    failures = getattr(error, "failures", None)
    if not failures:
        return None
    errors = [failure[0] for failure in failures.values()]
    read_errors = (pickle.UnpicklingError, EOFError, ValueError, OSError, KeyError)
    if not all(isinstance(failure, read_errors) for failure in errors):
        return None
    path = os.fspath(directory)
    files = sorted(
        {info.relative_path for info in (metadata.storage_data or {}).values()}
    )
    named = [os.path.join(path, name) for name in files]
    where = f"its data file {named[0]}" if len(named) == 1 else f"one of {named}"
    first = errors[0]
    # The first sentence (torch's weights-only error goes on about trust).
    reason = str(first).strip().splitlines()[0].split(". ")[0][:300]
    ranks = sorted(failures)
    return ValueError(
        f"torch.distributed.checkpoint cannot read {where} (process(es) "
        f"{ranks}: {type(first).__name__}: {reason}): the file is damaged. "
        "Restore an earlier checkpoint."
    )


def _failure(action: str, directory: Any, error: BaseException) -> RuntimeError:
    _, rank = _world()
    return RuntimeError(
        f"Process {rank}: torch.distributed.checkpoint could not {action} "
        f"{os.fspath(directory)!r}: {type(error).__name__}: {error}"
    )


class Pending:
    """A save of this process (see `keras_dist.checkpoint.engine`)."""

    def __init__(self, directory: Any, future: Any = None):
        self._directory = directory
        self._future = future
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout_seconds: float) -> None:
        if self._error is not None:
            raise self._error
        if self._future is None:
            return
        try:
            self._future.result(timeout=timeout_seconds)
        except concurrent.futures.TimeoutError:
            _, rank = _world()
            raise RuntimeError(
                f"Process {rank}: the background save into "
                f"{os.fspath(self._directory)!r} did not finish within "
                f"{timeout_seconds:g} s; another process may have stopped saving "
                "(see its log)."
            ) from None
        # DCP's CheckpointException is a BaseException.
        except BaseException as error:  # noqa: BLE001
            self._error = _failure("save into", self._directory, error)
            self._future = None
            raise self._error from error
        self._future = None


def _wait_for_previous_save() -> None:
    while _in_flight:
        _in_flight.pop(0).wait(_PREVIOUS_SAVE_SECONDS)


# -- metric states -------------------------------------------------------------
def _per_process_metrics(state: dict[str, Any]) -> set[str]:
    """The keys of `state` whose variables each process holds its own value of
    (metric states under DDP)."""
    from keras_dist.backends.torch import metric_sync  # noqa: PLC0415

    if _world()[0] == 1:
        return set()
    return {
        key
        for key, variable in state.items()
        if metric_sync.metric_state_is_per_process(variable)
    }


def _global_metric_value(variable: Any, group: Any) -> Any:
    """The value of a per-process metric state over every process: summed for
    a "sum" state, averaged for a "mean" one, else process 0's."""
    torch, dist, _ = _torch()
    value = variable.value.detach().to("cpu", torch.float64, copy=True)
    if variable.aggregation in ("sum", "mean"):
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        if variable.aggregation == "mean":
            value = value / _world()[0]
    else:
        dist.broadcast(value, group_src=0, group=group)
    return value.to(variable.value.dtype)


def _local_metric_value(variable: Any, value: Any) -> Any:
    """What this process holds of a per-process metric state whose global
    value is `value`: all of it on process 0, zeros elsewhere for a "sum"."""
    if variable.aggregation == "sum" and _world()[1] != 0:
        return value * 0
    return value


# -- the engine ----------------------------------------------------------------
def save(directory: Any, state: dict[str, Any], *, background: bool) -> Pending:
    from keras_dist.backends.torch import keras_internals as internals  # noqa: PLC0415

    _, _, dcp = _torch()
    _wait_for_previous_save()
    group = _group()
    per_process = _per_process_metrics(state)
    state_dict = {}
    for key in sorted(state):
        variable = state[key]
        if key in per_process:
            state_dict[key] = _global_metric_value(variable, group)
        else:
            state_dict[key] = internals.variable_storage(variable).detach()
    writer = dcp.FileSystemWriter(
        os.fspath(directory), single_file_per_rank=True, overwrite=False
    )
    # A value every process holds whole is written once, by process 0: its
    # value wins, as DDP and DTensor take process 0's at the start (DCP's
    # default picks any process, and per-process states such as a Dropout's
    # seed under DTensor may differ).
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    options = {"storage_writer": writer, "process_group": group, "planner": planner}
    options["no_dist"] = group is None
    try:
        if not background:
            with _one_process():
                dcp.save(state_dict, **options)
            return Pending(directory)
        # Copies every value to CPU memory before it returns; the writing goes
        # on in a thread, its collectives on the checkpoint group.
        with _one_process():
            future = dcp.async_save(state_dict, **options)
    except BaseException as error:  # DCP's CheckpointException included
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        raise _failure("save into", directory, error) from error
    pending = Pending(directory, future)
    _in_flight.append(pending)
    return pending


def _read_metadata(directory: Any) -> Any:
    """DCP's metadata of a finished save in `directory`; a clear error for an
    unfinished one (no `.metadata`, or a data file missing or short)."""
    _, _, dcp = _torch()
    path = os.fspath(directory)
    if not os.path.isfile(os.path.join(path, _METADATA)):
        raise ValueError(
            f"{path!r} holds no finished torch.distributed.checkpoint: its "
            f"{_METADATA!r} file, which the save writes last, is missing. The "
            "save that wrote it was interrupted (or it is not a PyTorch "
            "checkpoint); restore an earlier checkpoint."
        )
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # a pickle error, EOFError, ...
        raise ValueError(
            f"torch.distributed.checkpoint cannot read its file "
            f"{os.path.join(path, _METADATA)} ({type(error).__name__}: {error}): "
            "the file is damaged. Restore an earlier checkpoint."
        ) from error
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            raise ValueError(
                f"{path!r} is an incomplete torch.distributed.checkpoint: its "
                f"data file {name!r} is {'missing' if have is None else 'short'} "
                f"({have} bytes, {size} needed). Restore an earlier checkpoint."
            )
    return metadata


def _check_keys(directory: Any, metadata: Any, keys: Any) -> None:
    missing = sorted(set(keys) - set(metadata.state_dict_metadata))
    if missing:
        raise ValueError(
            f"The checkpoint {os.fspath(directory)!r} has no value for {missing}; "
            f"it holds {sorted(metadata.state_dict_metadata)}. Restore it into "
            "the model that saved it (same layers and optimizer)."
        )


def _check_shape(key: str, variable: Any, shape: Any) -> None:
    if tuple(int(s) for s in variable.shape) != tuple(int(s) for s in shape):
        raise ValueError(
            f"The checkpoint holds {key!r} with shape {tuple(shape)}, but the "
            f"variable {variable.path!r} it restores has shape "
            f"{tuple(variable.shape)}. Restore it into the model that saved it."
        )


def load(directory: Any, state: dict[str, Any], entries: dict[str, Any]) -> None:
    from keras_dist.backends.torch import keras_internals as internals  # noqa: PLC0415

    torch, _, dcp = _torch()
    _wait_for_previous_save()
    metadata = _read_metadata(directory)
    _check_keys(directory, metadata, state)
    group = _group()
    per_process = _per_process_metrics(state)
    targets = {}
    for key, variable in state.items():
        saved = metadata.state_dict_metadata[key]
        _check_shape(key, variable, saved.size)
        if key in per_process:
            targets[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        else:
            # In place, into the tensor (or this process' shard of the DTensor)
            # the variable holds: each process reads only what it holds.
            targets[key] = internals.variable_storage(variable).detach()
    try:
        with _one_process():
            dcp.load(
                targets,
                storage_reader=dcp.FileSystemReader(os.fspath(directory)),
                process_group=group,
                no_dist=group is None,
            )
    except BaseException as error:  # DCP's CheckpointException included
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        damaged = _damaged_data(directory, metadata, error)
        if damaged is not None:
            raise damaged from error
        raise _failure("load", directory, error) from error
    for key in sorted(per_process):
        variable = state[key]
        variable.assign(_local_metric_value(variable, targets[key]))


def _numpy(tensor: Any, dtype: str) -> np.ndarray:
    torch, _, _ = _torch()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes  # noqa: PLC0415 (a Keras dependency)

        array = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = tensor.numpy()
    if dtype and str(array.dtype) != dtype:
        return array.astype(dtype)
    return array


def read_arrays(directory: Any, entries: dict[str, Any]) -> dict[str, np.ndarray]:
    torch, _, dcp = _torch()
    metadata = _read_metadata(directory)
    _check_keys(directory, metadata, entries)
    targets = {}
    for key, entry in entries.items():
        saved = metadata.state_dict_metadata[key]
        shape = tuple(int(s) for s in saved.size)
        if "shape" in entry and tuple(entry["shape"]) != shape:
            raise ValueError(
                f"The manifest of {os.fspath(directory)!r} gives {key!r} the "
                f"shape {tuple(entry['shape'])}, but its torch.distributed."
                f"checkpoint holds {shape}: the checkpoint was altered."
            )
        targets[key] = torch.empty(shape, dtype=saved.properties.dtype)
    try:
        with _one_process():
            dcp.load(
                targets,
                storage_reader=dcp.FileSystemReader(os.fspath(directory)),
                no_dist=True,
            )
    except BaseException as error:  # DCP's CheckpointException included
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        damaged = _damaged_data(directory, metadata, error)
        if damaged is not None:
            raise damaged from error
        raise _failure("read", directory, error) from error
    return {
        key: _numpy(targets[key], entries[key].get("dtype")) for key in sorted(targets)
    }


def assign_arrays(state: dict[str, Any], arrays: dict[str, Any]) -> None:
    missing = sorted(set(state) - set(arrays))
    if missing:
        raise ValueError(
            f"No array for {missing} among the checkpoint's values "
            f"{sorted(arrays)}. Restore it into the model that saved it."
        )
    per_process = _per_process_metrics(state)
    for key in sorted(state):
        variable, value = state[key], np.asarray(arrays[key])
        _check_shape(key, variable, value.shape)
        # Under ModelParallel each process keeps its part of the full value
        # (`split_state._as_placed`); DDP replicas each take all of it.
        if key in per_process:
            value = _local_metric_value(variable, value)
        variable.assign(value)
