"""Optimizer slots that live in host memory (`offload="optimizer"`) made
there: never a copy on the device on the way (JAX).

```
slot made (Optimizer.build)   layout: its variable's, memory_kind="pinned_host"
  constant initializer        each device's part filled on the host (NumPy)
  (zeros, ones, Constant)     and put straight into pinned host memory
  any other initializer       jitted with that layout as its output sharding
```

A slot made on the device and moved after holds, for a moment, device memory
the step's plan does not count (and an asynchronous move holds it longer):
the whole optimizer state, at worst, where the plan counts none of it.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np

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
        return initializer.get_config()["value"]
    return None


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
    return jax.jit(
        lambda: initializer(shape, dtype=dtype), out_shardings=sharding
    )()
