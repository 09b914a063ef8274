"""Where each optimizer slot is made (JAX): laid out as the variable it
mirrors, and one that lives in host memory (`offload="optimizer"`) made
there, never a copy on the device on the way.

```
slot made (Optimizer.build)   a split variable's: laid out as it at once
offloaded state slot          its variable's layout, memory_kind="pinned_host"
  constant initializer        each device's part filled on the host (NumPy)
  (zeros, ones, Constant)     and put straight into pinned host memory
  any other initializer       jitted with that layout as its output sharding
```

A slot made on the device and moved after holds, for a moment, device memory
the step's plan does not count (and an asynchronous move holds it longer):
the whole optimizer state, at worst, where the plan counts none of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np

from keras_dist.backends.jax import keras_internals as internals
from keras_dist.backends.jax import offload
from keras_dist.keras_compat.optimizers import is_state_slot

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def backend_sharding(layout: Any) -> Any:
    """`layout` (a Keras `TensorLayout` or a JAX sharding) as a JAX sharding."""
    return getattr(layout, "backend_layout", layout)


def in_host_memory(layout: Any) -> bool:
    """Whether `layout` puts its array in host memory."""
    sharding = backend_sharding(layout)
    return getattr(sharding, "memory_kind", None) in HOST_MEMORY_KINDS


def constant_of(initializer: Any) -> Any:
    """The value a constant Keras initializer fills with (`Zeros`, `Ones`,
    `Constant`), else None."""
    if isinstance(initializer, keras.initializers.Zeros):
        return 0
    if isinstance(initializer, keras.initializers.Ones):
        return 1
    if isinstance(initializer, keras.initializers.Constant):
        return np.asarray(initializer.value)
    return None


def slots_in_place(
    model: Any, distribution: Any, check_divides: Callable[[Any, Any], None]
) -> Any:
    """A context manager while `model`'s optimizer is built under
    `distribution`: with layouts that split variables each slot is laid out
    as the variable it mirrors the moment Keras makes it (`each_new_slot`),
    so the optimizer's state is never all whole on one device (Adam's: twice
    the model); a state slot that `offload=` keeps in host memory is made
    there, in `optimizer_state_dtype=`. `check_divides(variable, layout)`
    raises `ValueError` for a layout that does not divide the variable (the
    run's start refuses it, with the whole plan)."""
    optimizer = getattr(model, "optimizer", None)
    placement = getattr(distribution, "state_placement", None)
    if (
        not isinstance(distribution, keras.distribution.ModelParallel)
        and placement is None
    ) or (optimizer is None or optimizer.built):
        return contextlib.nullcontext()

    def made(reference: Any, slot: Any) -> None:
        layout = distribution.layout_for_variable(reference)
        if is_state_slot(slot):
            layout = offload.slot_layout(placement, layout)
        if all(axis is None for axis in getattr(layout, "axes", (0,))):
            return
        try:
            check_divides(slot, layout)
        except ValueError:
            return  # the run's start refuses it, with the whole plan
        internals.relayout_variable(slot, layout)

    return offload.each_new_slot(
        optimizer,
        made,
        placement,
        state_layout=slot_layouts(distribution, placement, check_divides),
    )


def slot_layouts(
    distribution: Any, placement: Any, check_divides: Callable[[Any, Any], None]
) -> Callable[[Any], Any] | None:
    """Under `offload=`, the layout a state slot of a variable is made in:
    its variable's, in host memory; None where that layout does not divide
    the variable (`check_divides` raises: the run's start refuses it, with
    the whole plan). Without `offload=`, None: slots made as Keras makes
    them."""
    if placement is None or not placement.offloads_slots:
        return None

    def layout_for(reference: Any) -> Any:
        layout = distribution.layout_for_variable(reference)
        try:
            check_divides(reference, layout)
        except ValueError:
            return None
        return offload.host_layout(layout)

    return layout_for


def made_in_host_memory(initializer: Any, shape: Any, dtype: Any, layout: Any) -> Any:
    """The first value of a variable of `shape` and `dtype` laid out on
    `layout`, built in host memory, when `layout` is in host memory; else
    None (the device's way, Keras' own)."""
    if not in_host_memory(layout):
        return None
    sharding = backend_sharding(layout)
    shape = tuple(int(size) for size in shape)
    numpy_dtype = jax.numpy.dtype(dtype)
    value = constant_of(initializer)
    if value is not None:
        # A broadcast view: each device's part alone is ever filled.
        whole = np.broadcast_to(np.asarray(value, numpy_dtype), shape)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: np.ascontiguousarray(whole[index])
        )
    return jax.jit(lambda: initializer(shape, dtype=dtype), out_shardings=sharding)()
