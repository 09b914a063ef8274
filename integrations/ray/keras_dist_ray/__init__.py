"""keras_dist on Ray Train: `KerasTrainer` starts the workers, `kd.initialize()`
finds the job in each, and `ReportCallback` reports to Ray.

```python
import keras_dist as kd
from ray.train import FailureConfig, RunConfig, ScalingConfig
from keras_dist_ray import KerasTrainer, ReportCallback


def train_fn(config):
    kd.initialize()  # rank, size and coordinator from Ray Train
    model = build_model()
    checkpoint = kd.Checkpoint(config["checkpoint_dir"])
    model.fit(
        x, y, epochs=10,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            checkpoint,
            ReportCallback(checkpoint),
        ],
    )


KerasTrainer(
    train_fn,
    train_loop_config={"checkpoint_dir": "/shared/run-1/checkpoints"},
    scaling_config=ScalingConfig(num_workers=4, use_gpu=True),
    run_config=RunConfig(failure_config=FailureConfig(max_failures=3)),
).fit()
```

Importing this package imports Ray, not Keras: `ReportCallback` (a Keras
callback) is imported when first used, so a driver that only starts the
trainer needs no Keras backend.
"""

from __future__ import annotations

from keras_dist_ray.backend import KerasConfig
from keras_dist_ray.trainer import KerasTrainer

__all__ = ["KerasConfig", "KerasTrainer", "ReportCallback"]


def __getattr__(name: str):
    if name == "ReportCallback":
        from keras_dist_ray.callback import ReportCallback  # noqa: PLC0415

        return ReportCallback
    raise AttributeError(f"module 'keras_dist_ray' has no attribute {name!r}")
