"""The JAX checkpoint engine: Orbax (`keras_dist.checkpoint.engine`).

Each process writes only the shards its devices hold (of a replicated value,
Orbax writes one copy), into `<directory>/orbax/`, with Orbax's own atomic
commit: the primary process renames `orbax.orbax-checkpoint-tmp*` to `orbax`
once every process has written its part. Orbax's barriers run on the JAX
coordination service with a timeout (`MultiprocessingOptions(active_processes=
...)`), never as device collectives that could hang.

The variables are saved as one tree, the keys split on `/`
(`layers/dense/vars/0` -> `["layers"]["dense"]["vars"]["0"]`), so Orbax's own
tools read the checkpoint too.

orbax-checkpoint is imported inside the functions: `pip install
keras-dist[jax]`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

ENGINE = "orbax"

# The subdirectory of a step directory that Orbax writes.
ITEM = "orbax"
# Orbax's barriers between processes (coordination service) give up after this.
BARRIER_TIMEOUT_SECONDS = 300
# A save first waits this long for the previous background save of the process.
PREVIOUS_SAVE_TIMEOUT_SECONDS = 600.0
# Files Orbax writes last into a finished checkpoint.
_FINAL_FILES = ("_CHECKPOINT_METADATA", "_METADATA")

_in_flight: list[_Pending] = []


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            "keras_dist checkpoints on JAX are written with Orbax, which is not "
            f"installed ({error}). Install it with `pip install keras-dist[jax]` "
            "(orbax-checkpoint>=0.12,<0.13)."
        ) from error
    return ocp


def _rank() -> int:
    import jax  # noqa: PLC0415

    return jax.process_index()


def _multiprocessing_options(ocp: Any, processes: set[int]) -> Any:
    return ocp.options.MultiprocessingOptions(
        primary_host=min(processes), active_processes=processes
    )


def _all_processes() -> set[int]:
    import jax  # noqa: PLC0415

    return set(range(jax.process_count()))


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a/b/0": x}` -> `{"a": {"b": {"0": x}}}`; Orbax names each value by
    its path joined with `.`, so two keys giving one name are refused."""
    tree: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key, value in flat.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"Checkpoint keys must be non-empty strings; received {key!r}."
            )
        parts = key.split("/")
        name = ".".join(parts)
        if name in names:
            raise ValueError(
                f"The checkpoint keys {names[name]!r} and {key!r} would be stored "
                f"under the same Orbax name {name!r}. Rename the layer whose name "
                "holds a '.'."
            )
        names[name] = key
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"The checkpoint key {key!r} runs through another key's value "
                    f"({part!r}); keys must not be prefixes of each other."
                )
            node = child
        if parts[-1] in node:
            raise ValueError(
                f"The checkpoint key {key!r} is also a prefix of other keys; keys "
                "must not be prefixes of each other."
            )
        node[parts[-1]] = value
    return tree


def _leaf(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("/"):
        node = node[part]
    return node


# --- save ---------------------------------------------------------------


class _Pending:
    """One process' save in flight; `wait(timeout_seconds)` and `done()`."""

    def __init__(self, checkpointer: Any, directory: Path, rank: int) -> None:
        self._checkpointer = checkpointer
        self._directory = directory
        self._rank = rank
        self._error: BaseException | None = None
        # Whether `wait` raised this save's error already.
        self.reported = False
        self._finished = threading.Event()
        self._thread = threading.Thread(
            target=self._finish,
            name=f"keras_dist-orbax-save-rank{rank}",
            daemon=True,
        )
        self._thread.start()

    def _finish(self) -> None:
        try:
            # Waits for Orbax's background write and commit, then releases it.
            self._checkpointer.close()
        except BaseException as error:  # noqa: BLE001 - reported by wait()
            self._error = error
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout_seconds: float) -> None:
        if not self._finished.wait(timeout_seconds):
            raise RuntimeError(
                f"Rank {self._rank}: the Orbax checkpoint save into "
                f"{self._directory} did not finish within {timeout_seconds} s. "
                "A process may have stopped or the file system may be slow; "
                "wait longer or look at the other ranks' logs."
            )
        if self._error is not None:
            self.reported = True
            raise RuntimeError(
                f"Rank {self._rank}: the Orbax checkpoint save into "
                f"{self._directory} failed: {type(self._error).__name__}: "
                f"{self._error}"
            ) from self._error


def save(directory: Any, state: Mapping[str, Any], *, background: bool) -> _Pending:
    """Writes `state`'s values into `<directory>/orbax`; every process calls
    it with the same keys and writes only its own shards."""
    ocp = _orbax()
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(
            f"save() writes into an existing directory; {str(directory)!r} is "
            "not one. Create it on process 0 before every process saves."
        )
    rank = _rank()
    while _in_flight:
        previous = _in_flight.pop(0)
        reported = previous.reported  # its error reached the caller already
        try:
            previous.wait(PREVIOUS_SAVE_TIMEOUT_SECONDS)
        except RuntimeError:
            if not reported:
                raise
    values = {}
    for key, variable in state.items():
        value = getattr(variable, "value", variable)
        values[key] = value if isinstance(value, jax.Array) else jnp.asarray(value)
    tree = _nest(values)
    multiprocessing_options = _multiprocessing_options(ocp, _all_processes())
    handler = ocp.PyTreeCheckpointHandler(
        multiprocessing_options=multiprocessing_options
    )
    if background:
        checkpointer = ocp.AsyncCheckpointer(
            handler,
            async_options=ocp.options.AsyncOptions(
                timeout_secs=BARRIER_TIMEOUT_SECONDS
            ),
            multiprocessing_options=multiprocessing_options,
        )
    else:
        checkpointer = ocp.Checkpointer(
            handler, multiprocessing_options=multiprocessing_options
        )
    # Returns once the values are on the host: the variables may change now.
    checkpointer.save(directory / ITEM, args=ocp.args.PyTreeSave(tree))
    pending = _Pending(checkpointer, directory, rank)
    if background:
        _in_flight.append(pending)
    else:
        pending.wait(BARRIER_TIMEOUT_SECONDS)
    return pending


# --- restore --------------------------------------------------------------


def _finished_item(directory: Any) -> Path:
    """`<directory>/orbax` if a save completed there, else a clear error."""
    directory = Path(directory)
    item = directory / ITEM
    if item.is_dir() and all((item / name).exists() for name in _FINAL_FILES):
        return item
    if not directory.is_dir():
        raise FileNotFoundError(
            f"No checkpoint directory at {str(directory)!r}; pass a step "
            "directory written by keras_dist."
        )
    found = sorted(path.name for path in directory.iterdir())
    raise ValueError(
        f"The Orbax checkpoint in {str(directory)!r} is incomplete: its save did "
        f"not finish (the directory holds {found}; a finished save holds "
        f"{ITEM!r}/ with {list(_FINAL_FILES)}). The process was probably "
        "stopped while saving; restore an earlier step."
    )


# Orbax's small JSON files (its data is in `d/` and `ocdbt.process_*/`).
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "array_metadatas")


def _read(item: Path, read: Any) -> Any:
    """`read()`, Orbax reading `item`; a file it cannot read is a
    `ValueError` naming the file (Orbax's own error may name none)."""
    try:
        return read()
    except (ValueError, OSError, KeyError, EOFError) as error:
        text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
        file = _file_named(str(error), item) or _unreadable_json(item)
        where = f"its file {file}" if file else f"its files under {item}"
        raise ValueError(
            f"Orbax cannot read {where} ({text}): the file is damaged. Restore "
            "an earlier checkpoint."
        ) from error


def _file_named(text: str, item: Path) -> str | None:
    """A file under `item` that Orbax's (TensorStore's) message names."""
    root = str(item).rstrip(os.sep) + os.sep
    start = text.find(root)
    while start >= 0:
        end = start + len(root)
        while end < len(text) and text[end] not in " \t\n'\"(),:":
            end += 1
        name = text[start:end].rstrip(".")
        if os.path.isfile(name):
            return name
        start = text.find(root, end)
    return None


def _unreadable_json(item: Path) -> str | None:
    """The first of Orbax's JSON files under `item` that does not parse."""
    import json  # noqa: PLC0415

    for name in _JSON_FILES:
        path = item / name
        for file in sorted(path.iterdir()) if path.is_dir() else [path]:
            if not file.is_file():
                continue
            try:
                json.loads(file.read_bytes().decode("utf-8"))
            except ValueError:
                return str(file)
    return None


def _saved_shapes(ocp: Any, item: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """`{key: (shape, dtype)}` of every saved value, from Orbax's metadata."""
    metadata = ocp.PyTreeCheckpointHandler().metadata(item)
    tree = getattr(metadata, "tree", metadata)
    saved: dict[str, tuple[tuple[int, ...], Any]] = {}

    def walk(node: Any, parts: list[str]) -> None:
        if isinstance(node, Mapping):
            for name, child in node.items():
                walk(child, [*parts, str(name)])
        else:
            saved["/".join(parts)] = (tuple(node.shape), node.dtype)

    walk(tree, [])
    return saved


def _check_entries(
    item: Path, saved: Mapping[str, Any], keys: Any, entries: Mapping[str, Any]
) -> None:
    missing = [key for key in keys if key not in entries]
    if missing:
        raise ValueError(
            f"The checkpoint's manifest has no entry for {missing}; it holds "
            f"{sorted(entries)}. Restore into the model that was saved."
        )
    absent = [key for key in keys if key not in saved]
    if absent:
        raise ValueError(
            f"The Orbax checkpoint {str(item)!r} holds no value for {absent} "
            "although the manifest lists them; the checkpoint is damaged."
        )
    for key in keys:
        shape = tuple(entries[key]["shape"])
        if saved[key][0] != shape:
            raise ValueError(
                f"The Orbax checkpoint {str(item)!r} holds {key!r} with shape "
                f"{saved[key][0]}, its manifest says {shape}; the checkpoint is "
                "damaged."
            )


def _restore(
    ocp: Any,
    item: Path,
    target: dict[str, Any],
    restore_args: dict[str, Any],
    processes: set[int],
) -> Any:
    """Orbax reads the keys of `target`; `processes` all call it (its barriers
    span them)."""
    multiprocessing_options = _multiprocessing_options(ocp, processes)
    checkpointer = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing_options),
        multiprocessing_options=multiprocessing_options,
    )
    try:
        return checkpointer.restore(
            item,
            args=ocp.args.PyTreeRestore(
                item=_nest(target),
                restore_args=_nest(restore_args),
                partial_restore=True,
            ),
        )
    finally:
        checkpointer.close()


def load(directory: Any, state: Mapping[str, Any], entries: Mapping[str, Any]) -> None:
    """Every process: each variable of `state` gets its saved value, laid out
    the variable's current way; each process reads only its shards."""
    ocp = _orbax()
    import jax  # noqa: PLC0415

    item = _finished_item(directory)
    saved = _read(item, lambda: _saved_shapes(ocp, item))
    _check_entries(item, saved, list(state), entries)
    target, restore_args = {}, {}
    for key, variable in state.items():
        shape = tuple(entries[key]["shape"])
        if tuple(variable.shape) != shape:
            raise ValueError(
                f"Cannot restore {key!r}: the checkpoint holds shape {shape}, the "
                f"model's variable {variable.path!r} has shape "
                f"{tuple(variable.shape)}. Restore into the model that was saved."
            )
        value = variable.value
        sharding = value.sharding
        target[key] = jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)
        restore_args[key] = ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=shape, dtype=value.dtype
        )
    for keys in restore_groups(target):
        restored = _read(
            item,
            lambda keys=keys: _restore(
                ocp,
                item,
                {key: target[key] for key in keys},
                {key: restore_args[key] for key in keys},
                _all_processes(),
            ),
        )
        for key in keys:
            state[key].assign(_leaf(restored, key))
        del restored  # the values replaced go before the next group comes


def restore_groups(target: Mapping[str, Any]) -> list[list[str]]:
    """The keys of `target` (`jax.ShapeDtypeStruct`s with shardings) in the
    groups restored one after the other: each value restored stands beside
    the one it replaces until it is assigned, so the device holds at most
    one group's worth more than the model (the largest variable's bytes a
    group, per device). Values in host memory (offloaded optimizer slots)
    cost the device nothing: one group."""
    host = [
        key
        for key, struct in target.items()
        if struct.sharding.memory_kind in ("pinned_host", "unpinned_host")
    ]
    per_device = {
        key: _device_bytes(struct) for key, struct in target.items() if key not in host
    }
    budget = max(per_device.values(), default=0)
    groups, current, size = [], [], 0
    for key in per_device:
        if current and size + per_device[key] > budget:
            groups.append(current)
            current, size = [], 0
        current.append(key)
        size += per_device[key]
    return [group for group in (*groups, current, host) if group]


def _device_bytes(struct: Any) -> int:
    """The bytes of one device's shard of `struct`."""
    shard = struct.sharding.shard_shape(tuple(struct.shape))
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(struct.dtype).itemsize


def _keep_jax_on_the_cpu() -> None:
    """Reading needs no accelerator: in a torch or TensorFlow process JAX
    stays on the CPU (rather than taking most of a GPU's memory), unless the
    process chose JAX's platforms itself (once JAX's backends started, this
    changes nothing)."""
    import jax  # noqa: PLC0415

    if not (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms):
        jax.config.update("jax_platforms", "cpu")


def read_arrays(directory: Any, entries: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One process, any Keras backend: the full value of every key."""
    import keras  # noqa: PLC0415

    if keras.backend.backend() != "jax":
        _keep_jax_on_the_cpu()
    ocp = _orbax()

    item = _finished_item(directory)
    saved = _read(item, lambda: _saved_shapes(ocp, item))
    _check_entries(item, saved, list(entries), entries)
    target, restore_args = {}, {}
    for key in entries:
        shape, dtype = saved[key]
        target[key] = np.empty(shape, dtype)
        restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    restored = _read(item, lambda: _restore(ocp, item, target, restore_args, {_rank()}))
    return {key: np.asarray(_leaf(restored, key)) for key in entries}


def assign_arrays(state: Mapping[str, Any], arrays: Mapping[str, Any]) -> None:
    """Every process, the same full arrays: each variable gets its array, laid
    out the variable's current way."""
    import jax  # noqa: PLC0415

    missing = [key for key in state if key not in arrays]
    if missing:
        raise ValueError(
            f"No saved array for {missing}; the checkpoint holds "
            f"{sorted(arrays)}. Restore into the model that was saved."
        )
    for key, variable in state.items():
        array = np.asarray(arrays[key])
        if tuple(array.shape) != tuple(variable.shape):
            raise ValueError(
                f"Cannot restore {key!r}: the checkpoint holds shape "
                f"{tuple(array.shape)}, the model's variable {variable.path!r} has "
                f"shape {tuple(variable.shape)}. Restore into the model that was "
                "saved."
            )
        sharding = variable.value.sharding
        array = array.astype(variable.value.dtype, copy=False)
        value = jax.make_array_from_callback(
            array.shape, sharding, lambda index, array=array: array[index]
        )
        variable.assign(value)
