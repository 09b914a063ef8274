"""`KerasTrainer`: Ray Train's data-parallel trainer for keras_dist."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from keras_dist_ray.backend import KerasConfig


class KerasTrainer(DataParallelTrainer):
    """Run a keras_dist training function on a group of Ray Train workers.

    Ray Train starts `scaling_config.num_workers` workers (actors placed by
    Ray, on one node or many), the backend gives each the coordinator's
    address, and `train_loop_per_worker` runs on each. Inside it,
    `keras_dist.initialize()` without arguments forms the job (rank and size
    from Ray Train's worker context, see `keras_dist.cluster.RayEnvironment`)
    and `model.fit(..., callbacks=[kd.DistributeCallback(dist)])` trains as
    under `keras-dist launch`. `keras_dist_ray.ReportCallback` reports each
    epoch's metrics and the `kd.Checkpoint` checkpoints to Ray.

    With `RunConfig(failure_config=FailureConfig(max_failures=K))`, a worker
    that dies makes Ray stop the group and start a new one (a new coordinator
    included), up to K times; the training function runs again from its
    start and `kd.Checkpoint` resumes from the latest checkpoint in its
    directory.

    Elastic: with `ScalingConfig(num_workers=(min, max))` (Ray Train V2's
    elastic scaling), Ray starts the group on as many workers as the
    cluster's nodes have room for (at least `min`); when a node is lost it
    starts the group again smaller, and when nodes are added it grows it
    (checked every `elastic_resize_monitor_interval_s`). Each new group's
    `kd.Checkpoint` resumes exactly on its own worker count, with the same
    global batch (each worker's share changes), and says so on rank 0
    (`saved by 2 process(es), resuming on 1`). Each start after a lost node
    counts as one of `FailureConfig(max_failures)`; a resize to more workers
    does not.

    It is Ray's own `DataParallelTrainer` (Ray Train V2) with the keras_dist
    backend (`KerasConfig`); every other argument means what it means there.

    Args:
        train_loop_per_worker: the training function, with no argument or
            one (`train_loop_config`).
        train_loop_config: the argument given to it.
        keras_config: a `KerasConfig`; defaults to one running the driver's
            `KERAS_BACKEND` on the workers (when it is set).
        scaling_config: `ray.train.ScalingConfig` (workers, GPUs).
        run_config: `ray.train.RunConfig` (name, storage, failures).
        datasets, dataset_config: Ray Data datasets shared among the
            workers (`ray.train.get_dataset_shard`).

    Example:

    ```python
    result = KerasTrainer(
        train_fn, scaling_config=ray.train.ScalingConfig(num_workers=2)
    ).fit()
    ```
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[[], Any] | Callable[[dict], Any],
        *,
        train_loop_config: dict | None = None,
        keras_config: KerasConfig | None = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: Any = None,
    ) -> None:
        if keras_config is None:
            keras_config = KerasConfig(
                keras_backend=os.environ.get("KERAS_BACKEND", "").strip() or None
            )
        elif not isinstance(keras_config, KerasConfig):
            raise TypeError(
                "`keras_config` must be a keras_dist_ray.KerasConfig. Received: "
                f"keras_config={keras_config!r}"
            )
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=keras_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
        )
