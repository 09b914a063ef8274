"""The split state of PyTorch variables, around and between `ShardedRun`s.

- While any variable holds a DTensor (a run, or the optimizer's state a run
  left split), Keras variables read and assign like plain ones: `np.asarray`
  gathers (collective), assigning a plain value keeps this process' part
  (`patch_variables`, counted).
- A variable is split from process 0's value (`distribute`), and a value it
  no longer holds is freed at once (`free`).
- The optimizer's slots Keras builds during a call are split as each is made
  (`split_slot`, `split_when_made`), and with
  `FSDP(keep_optimizer_sharded=True)` (the default) they stay split between
  calls (`rest`, `take_resting`, `gather_resting`); reading one outside a call
  gathers them all once every process reads (a bounded barrier first).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from keras_dist.backends.torch import keras_internals as internals
from keras_dist.backends.torch import process_group
from keras_dist.backends.torch.fsdp_compute import to_full
from keras_dist.backends.torch.fsdp_plain import read_variable
from keras_dist.backends.torch.placements import is_sharded, placements, torch_mesh
from keras_dist.common import job
from keras_dist.keras_compat.optimizers import each_new_slot

# -- while a run is active, variables read and assign like plain ones ----------
# `np.asarray(variable)` (get_weights, checkpoints) gathers a DTensor, and
# assigning a plain value (set_weights, load_weights, EarlyStopping's restore)
# keeps this process' part of it. One set of patches for all active runs.
_variable_patches: list[Callable[[], None]] = []


def _as_placed(current: Any, value: Any) -> Any:
    """`value` laid out like `current` when that is a DTensor: every process
    holds the whole value, so each keeps its part (no communication).

    The part is cut where the value is (a NumPy value from `load_weights`, a
    checkpoint read whole: on the host) and only the part moves to this
    process' device, never the whole value (keras#21712)."""
    if not isinstance(current, DTensor) or isinstance(value, DTensor):
        return value
    if tuple(np.shape(value)) != tuple(current.shape):
        return value  # Keras names the wrong shape
    local_shape, offset = compute_local_shape_and_global_offset(
        current.shape, current.device_mesh, current.placements
    )
    index = tuple(
        slice(start, start + size)
        for start, size in zip(offset, local_shape, strict=True)
    )
    local = current.to_local()
    if isinstance(value, np.ndarray):
        # Keras' conversion: NumPy's bfloat16 and uint32, which torch lacks.
        part = keras.ops.convert_to_tensor(value[index])
    else:
        part = torch.as_tensor(value)[index]
    part = part.to(device=local.device, dtype=local.dtype).contiguous()
    return DTensor.from_local(
        part,
        current.device_mesh,
        current.placements,
        run_check=False,
        shape=current.shape,
        stride=current.stride(),
    )


def patch_variables() -> None:
    if not _variable_patches:
        undo_read = internals.convert_variables_to_numpy_via(_whole)
        undo_write = internals.assign_variables_via(_as_placed)
        undo_value = internals.read_variables_via(read_variable)

        def undo() -> None:
            undo_value()
            undo_write()
            undo_read()

        _variable_patches.append(undo)
    else:
        _variable_patches.append(_variable_patches[-1])


def unpatch_variables() -> None:
    if _variable_patches:
        undo = _variable_patches.pop()
        if not _variable_patches:
            undo()


def distribute(variable: Any, mesh: Any, where: Any) -> Any:
    """Make `variable` hold its part of process 0's value, as a DTensor
    Parameter with the placements `where`; returns it."""
    value = internals.variable_storage(variable)
    with torch.no_grad():
        sharded = distribute_tensor(value.detach(), mesh, where)
    parameter = torch.nn.Parameter(sharded, requires_grad=value.requires_grad)
    internals.set_variable_storage(variable, parameter)
    free(value, parameter)
    return parameter


def free(replaced: Any, kept: Any) -> None:
    """Free the memory of a value a variable no longer holds, now: the layers
    list the old Parameter until `retrack_parameters`, which would keep every
    replaced value alive until the last one is replaced (the whole model next
    to its parts). Its storage is emptied (`resize_(0)`, as FSDP2 frees what
    it gathered) unless `kept`, the new value, shares it (a replicated
    placement) or it is not torch's to resize (memory lent by numpy)."""
    storage = _local(replaced).untyped_storage()
    if (
        storage.data_ptr() != _local(kept).untyped_storage().data_ptr()
        and storage.resizable()
    ):
        storage.resize_(0)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def split_slot(distribution: Any, reference: Any, slot: Any) -> bool:
    """Split an optimizer slot just made for `reference` as the distribution
    lays `reference` out, when that layout shards it; whether it did. Each
    slot is split before the next is made, so the optimizer's state is never
    held whole (Adam's: 8 bytes a parameter); a `ShardedRun` takes the split
    slots over as they are."""
    layout = distribution.layout_for_variable(reference)
    if not is_sharded(layout) or isinstance(internals.variable_storage(slot), DTensor):
        return False
    mesh = torch_mesh(distribution.device_mesh)
    distribute(
        slot, mesh, placements(layout.axes, list(distribution.device_mesh.axis_names))
    )
    return True


@contextlib.contextmanager
def split_when_made(model: Any, distribution: Any) -> Iterator[None]:
    """Around a Keras call under `distribution` (`BackendAdapter.call_starting`):
    the slots Keras' own build makes for the model's optimizer, before the
    call's run starts, are split when made (`split_slot`). A slot still split
    when the call ends (its run never started: the call failed first) is
    gathered back into a plain tensor, as a run's end does, unless the run
    left it split on purpose (`_resting`)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        yield
        return
    split: list[Any] = []

    def made(reference: Any, slot: Any) -> None:
        if split_slot(distribution, reference, slot):
            split.append(slot)

    try:
        with each_new_slot(optimizer, made):
            yield
    finally:
        resting = {id(slot) for slot in _resting.get(id(model), ())}
        for slot in split:
            if id(slot) not in resting:
                gather(slot)


# -- the optimizer's state kept split between calls --------------------------------
# `FSDP(keep_optimizer_sharded=True)` (the default): id(model) -> the slots its
# last run left split. While any are, the variable patches stay on (reading one
# gathers them all, assigning one keeps this process' part).
_resting: dict[int, list[Any]] = {}
# id(the DTensor a resting slot holds) -> id(its model).
_resting_values: dict[int, int] = {}


def _whole(value: Any) -> Any:
    """The whole value of `value` for NumPy: a resting slot (the optimizer
    state a run left split) gathers every resting slot of its model back
    into whole tensors first, once every process is reading too
    (`_gather_resting_to_read`); a DTensor a run holds is gathered."""
    key = _resting_values.get(id(value)) if isinstance(value, DTensor) else None
    if key is not None:
        return _gather_resting_to_read(key)[id(value)]
    return to_full(value)


def _gather_resting_to_read(key: int) -> dict[int, Any]:
    """Gather the slots model `key`'s last run left split back into whole
    tensors, to be read (`model.save`, `save_weights`, `kd.export`, NumPy):
    a collective, so every process must be reading them. A bounded barrier
    first: a read on some processes only (`model.save` on process 0 alone)
    fails within `KERAS_DIST_INIT_TIMEOUT` seconds with an error naming the
    processes that did not come and the fix, instead of waiting forever in
    the gather. Returns id(old DTensor) -> its whole value."""
    slots = _resting.get(key, [])
    _everyone_reads(len(slots))
    gathered = {}
    for slot in take_resting_by_key(key):
        value = internals.variable_storage(slot)
        gather(slot)
        gathered[id(value)] = internals.variable_storage(slot)
    return gathered


def _everyone_reads(slots: int) -> None:
    seconds = job.timeout_seconds()
    try:
        process_group.bounded_barrier(seconds)
    except Exception as error:  # torch raises DistBackendError, RuntimeError
        rank = process_group.world()[1]
        raise RuntimeError(
            f"Process {rank} reads the optimizer state that kd.FSDP keeps split "
            f"between calls ({slots} variables; "
            "keep_optimizer_sharded=True, the default), which gathers it from "
            "every process, but not every process read it within "
            f"{seconds:g} s ({job.TIMEOUT_VARIABLE}): {error}. A save made on "
            "one process only (`if rank == 0: model.save(...)`) cannot gather "
            "it. Fix: call model.save / save_weights / kd.export on every "
            "process (process 0 writes the file, the others write nothing), "
            "save with kd.Checkpoint, or pass "
            "kd.FSDP(keep_optimizer_sharded=False) to gather the state when "
            "each call ends."
        ) from error


def gather(variable: Any) -> None:
    """Make a DTensor variable hold its whole value again (collective)."""
    value = internals.variable_storage(variable)
    if isinstance(value, DTensor):
        with torch.no_grad():
            full = torch.nn.Parameter(
                value.full_tensor(), requires_grad=value.requires_grad
            )
        internals.set_variable_storage(variable, full)
        free(value, full)


def rest(model: Any, slots: list[Any]) -> None:
    _resting[id(model)] = slots
    for slot in slots:
        _resting_values[id(internals.variable_storage(slot))] = id(model)
    patch_variables()
    weakref.finalize(model, _forget_resting, id(model), slots)


def _forget_values(key: int) -> None:
    for value, owner in list(_resting_values.items()):
        if owner == key:
            del _resting_values[value]


def _forget_resting(key: int, slots: list[Any]) -> None:
    if _resting.get(key) is slots:
        del _resting[key]
        _forget_values(key)
        unpatch_variables()


def take_resting(model: Any) -> list[Any]:
    """The slots `model`'s last run left split, no longer resting (a run takes
    them over, or they are gathered next)."""
    return take_resting_by_key(id(model))


def take_resting_by_key(key: int) -> list[Any]:
    slots = _resting.pop(key, None)
    if slots is None:
        return []
    _forget_values(key)
    unpatch_variables()
    return slots


def gather_resting(model: Any) -> None:
    """Gather back into whole tensors the optimizer state a run of `model`
    left split (collective; nothing when none is)."""
    for slot in take_resting(model):
        gather(slot)
