"""A Ray Train worker started by `keras_dist_ray.KerasTrainer`."""

from __future__ import annotations

import os
import sys

from keras_dist.cluster.addresses import split_address
from keras_dist.cluster.environments.base import (
    RAY_COORDINATOR_VARIABLE,
    ClusterEnvironment,
    at_least_one,
    environment_value,
    rank_in_range,
)


def _ray_train_context() -> object | None:
    """Ray Train's worker context when this process runs a Ray Train training
    function, else None. Never imports ray: a process that has not imported
    `ray.train` runs no training function of it."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        context = train.get_context()
        context.get_world_size()
    except Exception:  # noqa: BLE001
        # Ray raises RuntimeError outside a training function (the driver, a
        # task, an actor), DeprecationWarning in a Ray Tune function trainable;
        # either way this process is no Ray Train worker.
        return None
    return context


class RayEnvironment(ClusterEnvironment):
    """A worker of a Ray Train worker group started by
    `keras_dist_ray.KerasTrainer` (`integrations/ray`).

    The process count and the rank are the world size and world rank of Ray
    Train's worker context (`ray.train.get_context()`); the coordinator is
    `KERAS_DIST_RAY_COORDINATOR_ADDRESS`, which the trainer's backend sets on
    every worker before the training function runs: the IP of the node of
    the worker of world rank 0 and a port that was free there. A restarted
    worker group (Ray's `FailureConfig`) gets a new address.

    Detected when `ray.train` is imported and this process runs a Ray Train
    training function, either started by `KerasTrainer` (the variable is set)
    or in a group of several workers; keras_dist never imports ray itself. A
    group of several workers started by another trainer is an error naming
    `KerasTrainer`: Ray's `TorchTrainer` and `TensorflowTrainer` form the
    framework's job themselves, which `keras_dist.initialize()` does.
    """

    num_processes_source = "Ray Train's world size"
    process_id_source = "Ray Train's world rank"
    # The rank and size are no variables: Ray Train's context holds them.
    variables = (RAY_COORDINATOR_VARIABLE,)

    @staticmethod
    def detect() -> bool:
        context = _ray_train_context()
        if context is None:
            return False
        if environment_value(RAY_COORDINATOR_VARIABLE) is not None:
            return True
        return context.get_world_size() > 1

    def _context(self) -> object:
        context = _ray_train_context()
        if context is None:
            raise ValueError(
                "RayEnvironment reads Ray Train's worker context, and this "
                "process runs no Ray Train training function. Received: "
                f"{RAY_COORDINATOR_VARIABLE}="
                f"{os.environ.get(RAY_COORDINATOR_VARIABLE)!r}"
            )
        return context

    def coordinator_address(self) -> str:
        address = environment_value(RAY_COORDINATOR_VARIABLE)
        if address is None:
            context = self._context()
            raise ValueError(
                f"This process is worker {context.get_world_rank()} of a Ray "
                f"Train worker group of {context.get_world_size()}, but "
                f"{RAY_COORDINATOR_VARIABLE} is not set: the group was not "
                "started by keras_dist_ray.KerasTrainer, whose backend gives "
                "every worker the coordinator's address. Start the training "
                "function with keras_dist_ray.KerasTrainer(train_fn, "
                "scaling_config=...) instead of Ray's framework trainers "
                "(TorchTrainer forms the torch.distributed job that "
                "keras_dist.initialize() forms), or pass `job_addresses`, "
                "`num_processes` and `process_id` to keras_dist.initialize()."
            )
        try:
            split_address(address)
        except ValueError:
            raise ValueError(
                f"{RAY_COORDINATOR_VARIABLE} must be 'host:port'. Received: "
                f"{RAY_COORDINATOR_VARIABLE}={address!r}"
            ) from None
        return address

    def num_processes(self) -> int:
        return at_least_one("Ray Train's world size", self._context().get_world_size())

    def process_id(self) -> int:
        context = self._context()
        return rank_in_range(
            "Ray Train's world rank",
            context.get_world_rank(),
            "Ray Train's world size",
            context.get_world_size(),
        )

    def local_process_id(self) -> int | None:
        return self._context().get_local_rank()
