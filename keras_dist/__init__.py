"""keras_dist: `keras.distribution` for `model.fit` on every Keras backend.

Example:

```python
import keras_dist as kd

distribution = kd.DataParallel()
model.fit(x, y, batch_size=64, callbacks=[kd.DistributeCallback(distribution)])
```

`import keras_dist` itself imports neither Keras nor a backend, so that
`keras-dist --help` and the launcher start at once. The public API below loads
as a whole together with Keras: at once when Keras is already imported, else
right after Keras is imported, or at the first use of one of its names,
whichever comes first. That is also when keras_dist patches Keras (see
`keras_dist.keras_compat`), so the patches are in place before any model
exists. Simulated devices (`KERAS_DIST_CPU_DEVICES`) are set up at import,
before the backend starts: with that variable, importing keras_dist imports
the backend. Before that, on a host where libtpu is installed but JAX could
only find CPU devices, JAX starts its CPU backend alone (`JAX_PLATFORMS=cpu`,
unless set), without libtpu's errors (`keras_dist.common.tpu_host`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from keras_dist._version import __version__  # noqa: F401
from keras_dist.common import tpu_host
from keras_dist.runtime import device_simulation

# `keras_dist.distribution` is the function of the public API, not the
# subpackage of that name: a subpackage becomes an attribute of its parent when
# it is first imported, so import it now and take the attribute away again.
importlib.import_module("keras_dist.distribution")
globals().pop("distribution")


def _start_jax_without_libtpu() -> None:
    """libtpu (the `tpu` extra) on a host where JAX could only find CPU
    devices: JAX starts its CPU backend alone, without libtpu's errors."""
    platforms = tpu_host.jax_platforms_default()
    if platforms is None:
        return
    if "jax" in sys.modules:  # its configuration read the environment already
        module = importlib.import_module("keras_dist.backends.jax.platforms")
        module.default_platforms(platforms)
    else:
        os.environ["JAX_PLATFORMS"] = platforms


# Before simulating devices, which may start the backend.
_start_jax_without_libtpu()
# Simulated devices must be configured before the backend runtime starts.
device_simulation.apply_from_environment()

#: Each public name and the module that defines it.
_PUBLIC = {
    "Auto": "keras_dist.training.auto",
    "Checkpoint": "keras_dist.checkpoint",
    "DataParallel": "keras_dist.distribution.policies",
    "DeviceMesh": "keras_dist.distribution.mesh",
    "DistributeCallback": "keras_dist.callback",
    "Distribution": "keras_dist.distribution.policies",
    "FSDP": "keras_dist.distribution.policies",
    "LayoutMap": "keras_dist.distribution.layout_map",
    "MixedPrecisionPolicy": "keras_dist.distribution.mixed_precision",
    "ModelParallel": "keras_dist.distribution.policies",
    "OutOfDeviceMemoryError": "keras_dist.training.out_of_memory",
    "Plan": "keras_dist.planner",
    "Problem": "keras_dist.planner",
    "TensorLayout": "keras_dist.distribution.mesh",
    "Trainer": "keras_dist.trainer",
    "distribute_tensor": "keras_dist.distribution.state",
    "distribution": "keras_dist.distribution.state",
    "export": "keras_dist.checkpoint",
    "get_device_count": "keras_dist.runtime.api",
    "initialize": "keras_dist.runtime.api",
    "list_devices": "keras_dist.runtime.api",
    "num_processes": "keras_dist.runtime.api",
    "plan": "keras_dist.planner",
    "plan_search": "keras_dist.planner",
    "process_id": "keras_dist.runtime.api",
    "restore": "keras_dist.checkpoint",
    "scale_learning_rate": "keras_dist.schedules",
    "set_distribution": "keras_dist.distribution.state",
}
#: The public submodules.
_SUBMODULES = ("callbacks", "checkpoint", "flops", "layouts", "schedules")

__all__ = [
    "Auto",
    "Checkpoint",
    "DataParallel",
    "DeviceMesh",
    "DistributeCallback",
    "Distribution",
    "FSDP",
    "LayoutMap",
    "MixedPrecisionPolicy",
    "ModelParallel",
    "OutOfDeviceMemoryError",
    "Plan",
    "Problem",
    "TensorLayout",
    "Trainer",
    "callbacks",
    "checkpoint",
    "distribute_tensor",
    "distribution",
    "export",
    "flops",
    "get_device_count",
    "initialize",
    "layouts",
    "list_devices",
    "num_processes",
    "plan",
    "plan_search",
    "process_id",
    "restore",
    "scale_learning_rate",
    "schedules",
    "set_distribution",
]


_api = {"loaded": False, "loading": False}


def _load_api() -> None:
    """Import the public API (idempotent; a call made while it loads, from the
    import of Keras it starts, returns at once)."""
    if _api["loaded"] or _api["loading"]:
        return
    _api["loading"] = True
    try:
        # All or nothing: a name is bound only once every module loaded.
        names = {
            name: getattr(importlib.import_module(module_name), name)
            for name, module_name in _PUBLIC.items()
        }
        names.update(
            (name, importlib.import_module(f"keras_dist.{name}"))
            for name in _SUBMODULES
        )
        globals().update(names)
        _api["loaded"] = True
    finally:
        _api["loading"] = False


class _LoadWithKeras(importlib.abc.MetaPathFinder):
    """Loads the public API right after Keras itself is imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "keras":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            keras_exec_module = loader.exec_module

            def exec_module(module: Any) -> None:
                keras_exec_module(module)
                # Keras works without keras_dist: a failure here must not
                # break `import keras`; the first use of keras_dist's API
                # loads it again and raises it.
                with contextlib.suppress(Exception):
                    _load_api()

            loader.exec_module = exec_module
        return spec


def __getattr__(name: str) -> Any:
    if name in _PUBLIC or name in _SUBMODULES:
        _load_api()
        return globals()[name]
    raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if "keras" in sys.modules:
    _load_api()
else:
    sys.meta_path.insert(0, _LoadWithKeras())


if TYPE_CHECKING:  # what the names are, for type checkers and the API docs
    from keras_dist import callbacks, checkpoint, flops, layouts, schedules
    from keras_dist.callback import DistributeCallback
    from keras_dist.checkpoint import Checkpoint, export, restore
    from keras_dist.distribution.layout_map import LayoutMap
    from keras_dist.distribution.mesh import DeviceMesh, TensorLayout
    from keras_dist.distribution.mixed_precision import MixedPrecisionPolicy
    from keras_dist.distribution.policies import (
        FSDP,
        DataParallel,
        Distribution,
        ModelParallel,
    )
    from keras_dist.distribution.state import (
        distribute_tensor,
        distribution,
        set_distribution,
    )
    from keras_dist.planner import Plan, Problem, plan, plan_search
    from keras_dist.runtime.api import (
        get_device_count,
        initialize,
        list_devices,
        num_processes,
        process_id,
    )
    from keras_dist.schedules import scale_learning_rate
    from keras_dist.trainer import Trainer
    from keras_dist.training.auto import Auto
    from keras_dist.training.out_of_memory import OutOfDeviceMemoryError
