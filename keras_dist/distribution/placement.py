"""Where the optimizer's state lives and in which dtype: a distribution's
`offload=` and `optimizer_state_dtype=`, read by the step builder and the
plan (one place decides; the checkpoint saves and restores the slots where
and as they are).

```
                      slots (Adam's moments,    step counter, learning
                      any optimizer's per-      rate, gradient accumulators,
                      variable state)           EMA averages, weights
offload=None          device memory             device memory
offload="optimizer"   pinned host memory;       device memory
                      each variable's slots
                      moved in for its update
                      only, written back after
optimizer_state_dtype the slots' dtype (e.g.    their own dtype
                      "bfloat16"); the update
                      computes in float32
```

The same names elsewhere: MaxText's `optimizer_memory_host_offload` and
`mu_dtype`, PyTorch FSDP2's `CPUOffloadPolicy`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import keras

from keras_dist.backends import get_adapter

OFFLOAD_MODES = (None, "optimizer")
#: Offloading the weights as well is named but refused (not implemented).
REFUSED_OFFLOAD_MODES = ("optimizer+params",)
HOST_MEMORY = "pinned_host"


def _check_offload(offload: Any) -> str | None:
    if offload in REFUSED_OFFLOAD_MODES:
        raise NotImplementedError(
            f"offload={offload!r} (the weights in host memory too) is not "
            "implemented: the weights are read by every forward and backward "
            "pass, so streaming them costs two transfers a step where the "
            "optimizer's state costs one. Use offload='optimizer'."
        )
    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"`offload` must be one of {list(OFFLOAD_MODES)}. Received: "
            f"offload={offload!r}"
        )
    return offload


def _check_state_dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    try:
        name = keras.backend.standardize_dtype(dtype)
    except ValueError:
        name = None
    if name is None or "float" not in name:
        raise ValueError(
            "`optimizer_state_dtype` must be a floating dtype such as "
            f"'bfloat16' or 'float32', or None. Received: "
            f"optimizer_state_dtype={dtype!r}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class StatePlacement:
    """Where a distribution keeps the optimizer's slots and in which dtype.

    Backends read it from `distribution.state_placement` (None when nothing
    moves: the slots on the device in their variable's dtype)."""

    offload: str | None = None
    optimizer_state_dtype: str | None = None

    @property
    def slot_memory(self) -> str:
        """`"pinned_host"` when the slots live in host memory, else `"device"`."""
        return HOST_MEMORY if self.offload == "optimizer" else "device"

    @property
    def offloads_slots(self) -> bool:
        return self.offload == "optimizer"

    def slot_dtype(self, variable_dtype: Any) -> str:
        """The dtype a slot of a variable of `variable_dtype` is stored in."""
        dtype = keras.backend.standardize_dtype(variable_dtype)
        if self.optimizer_state_dtype is None or "float" not in dtype:
            return dtype
        return self.optimizer_state_dtype


def state_placement(offload: Any, optimizer_state_dtype: Any) -> StatePlacement | None:
    """The checked placement of `offload=` and `optimizer_state_dtype=`, or
    None for the defaults. The backend's reason it cannot do it
    (`state_placement_problem`) is raised as `NotImplementedError`."""
    placement = StatePlacement(
        _check_offload(offload), _check_state_dtype(optimizer_state_dtype)
    )
    if placement == StatePlacement():
        return None
    reason = get_adapter().state_placement_problem(placement)
    if reason is not None:
        raise NotImplementedError(reason)
    return placement


class PlacesState:
    """The `offload` and `optimizer_state_dtype` properties of a distribution.

    offload: keyword only. None (the default): the optimizer's state on the
        devices. `"optimizer"`: each optimizer slot (Adam's moments, SGD's
        momentum: any slot Keras makes from a model variable) lives in pinned
        host memory between steps, sharded as its variable; inside the
        compiled step each variable's slots come to the device for its own
        update only and go back right after, one variable at a time, so the
        device holds the weights, the gradients and one variable's slots
        (MaxText's `optimizer_memory_host_offload`). The step counter,
        learning rate and gradient accumulators stay on the device. JAX only.
    optimizer_state_dtype: keyword only. None (the default): each slot in
        its variable's dtype. A float dtype (`"bfloat16"`, MaxText's
        `mu_dtype`): the slots are stored in it; each update is computed in
        float32 (the slots cast up before it, down when stored). JAX only.
    """

    _state_placement: StatePlacement | None = None

    @property
    def state_placement(self) -> StatePlacement | None:
        """Where the optimizer's state lives (None: on the devices, in each
        variable's dtype)."""
        return self._state_placement

    @property
    def offload(self) -> str | None:
        """What lives in host memory (`offload=`): None or `"optimizer"`."""
        placement = self._state_placement
        return None if placement is None else placement.offload

    @property
    def optimizer_state_dtype(self) -> str | None:
        """The dtype the optimizer's slots are stored in, or None (each
        variable's own)."""
        placement = self._state_placement
        return None if placement is None else placement.optimizer_state_dtype

    def with_options(self, **options: Any) -> Any:
        """A copy of this distribution (same mesh, layouts and settings) with
        some of `remat`, `offload` and `optimizer_state_dtype` changed, as
        the constructor takes them (the memory savers a plan compiles)."""
        # Imported here: the policies import this module.
        from keras_dist.distribution.remat import check_remat  # noqa: PLC0415

        allowed = ("remat", "offload", "optimizer_state_dtype")
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(f"with_options takes {allowed}. Received: {unknown}")
        twin = copy.copy(self)
        if "remat" in options:
            twin._remat = check_remat(options["remat"])
        if {"offload", "optimizer_state_dtype"} & set(options):
            twin._state_placement = state_placement(
                options.get("offload", self.offload),
                options.get("optimizer_state_dtype", self.optimizer_state_dtype),
            )
        return twin
