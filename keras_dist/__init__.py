"""keras_dist: `keras.distribution` for `model.fit` on every Keras backend.

Example:

```python
import keras_dist as kd

distribution = kd.DataParallel()
model.fit(x, y, batch_size=64, callbacks=[kd.DistributeCallback(distribution)])
```

The public names load on first use (PEP 562), so that `keras-dist launch`,
which only starts processes, does not import Keras and a backend. Simulated
devices (`KERAS_DIST_CPU_DEVICES`) are still configured on import, before the
backend runtime starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from keras_dist import _device_simulation

# Simulated devices must be configured before the backend runtime starts
# (this imports Keras and the backend only when the variable asks for them).
_device_simulation.apply_from_environment()

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "DataParallel": "keras_dist.policies",
    "DeviceMesh": "keras_dist.mesh",
    "DistributeCallback": "keras_dist.callback",
    "Distribution": "keras_dist.policies",
    "LayoutMap": "keras_dist.layout_map",
    "ModelParallel": "keras_dist.policies",
    "TensorLayout": "keras_dist.mesh",
    "Trainer": "keras_dist.trainer",
    "distribute_tensor": "keras_dist.state",
    "distribution": "keras_dist.state",
    "get_device_count": "keras_dist.runtime",
    "initialize": "keras_dist.runtime",
    "list_devices": "keras_dist.runtime",
    "num_processes": "keras_dist.runtime",
    "process_id": "keras_dist.runtime",
    "set_distribution": "keras_dist.state",
}

__all__ = [
    "DataParallel",
    "DeviceMesh",
    "DistributeCallback",
    "Distribution",
    "LayoutMap",
    "ModelParallel",
    "TensorLayout",
    "Trainer",
    "distribute_tensor",
    "distribution",
    "get_device_count",
    "initialize",
    "list_devices",
    "num_processes",
    "process_id",
    "set_distribution",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from keras_dist.callback import DistributeCallback
    from keras_dist.layout_map import LayoutMap
    from keras_dist.mesh import DeviceMesh, TensorLayout
    from keras_dist.policies import DataParallel, Distribution, ModelParallel
    from keras_dist.runtime import (
        get_device_count,
        initialize,
        list_devices,
        num_processes,
        process_id,
    )
    from keras_dist.state import distribute_tensor, distribution, set_distribution
    from keras_dist.trainer import Trainer
