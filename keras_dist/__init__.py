"""keras_dist: `keras.distribution` for `model.fit` on every Keras backend.

Example:

```python
import keras_dist as kd

distribution = kd.DataParallel()
model.fit(x, y, batch_size=64, callbacks=[kd.DistributeCallback(distribution)])
```
"""

from keras_dist import _device_simulation

# Simulated devices must be configured before the backend runtime starts.
_device_simulation.apply_from_environment()

from keras_dist import callbacks, flops, layouts, schedules  # noqa: E402
from keras_dist.callback import DistributeCallback  # noqa: E402
from keras_dist.checkpoint import Checkpoint, export, restore  # noqa: E402
from keras_dist.layout_map import LayoutMap  # noqa: E402
from keras_dist.mesh import DeviceMesh, TensorLayout  # noqa: E402
from keras_dist.planner import Plan, Problem, plan  # noqa: E402
from keras_dist.policies import (  # noqa: E402
    FSDP,
    DataParallel,
    Distribution,
    ModelParallel,
)
from keras_dist.runtime import (  # noqa: E402
    get_device_count,
    initialize,
    list_devices,
    num_processes,
    process_id,
)
from keras_dist.schedules import scale_learning_rate  # noqa: E402
from keras_dist.state import (  # noqa: E402
    distribute_tensor,
    distribution,
    set_distribution,
)
from keras_dist.trainer import Trainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "DataParallel",
    "DeviceMesh",
    "DistributeCallback",
    "Distribution",
    "FSDP",
    "LayoutMap",
    "ModelParallel",
    "Plan",
    "Problem",
    "TensorLayout",
    "Trainer",
    "callbacks",
    "distribute_tensor",
    "distribution",
    "export",
    "flops",
    "layouts",
    "get_device_count",
    "initialize",
    "list_devices",
    "plan",
    "num_processes",
    "process_id",
    "restore",
    "scale_learning_rate",
    "schedules",
    "set_distribution",
]
