"""The Ray Train backend of `KerasTrainer`: it gives every worker the address
of the job's coordinator, and `keras_dist.initialize()` does the rest.

Ray's framework backends (`TorchConfig`, `TensorflowConfig`, `JaxConfig` on
GPUs and TPUs) form the framework's job themselves: `TorchConfig` calls
`torch.distributed.init_process_group`, `TensorflowConfig` writes `TF_CONFIG`.
keras_dist forms the job itself in `keras_dist.initialize()` (the roll call
that names missing ranks, then `init_process_group`,
`jax.distributed.initialize` or a `MultiWorkerMirroredStrategy`), so this
backend only publishes where the coordinator is, as Ray's `TorchConfig` does
with `MASTER_ADDR`: the IP of the node of the worker of world rank 0 and a
port free there, chosen anew each time Ray (re)starts the worker group.
"""

from __future__ import annotations

import dataclasses
import os

from ray.train.backend import Backend, BackendConfig

from keras_dist.cluster import find_free_port, join_address

#: The variable `keras_dist.cluster.RayEnvironment` reads (the same name as
#: `keras_dist.cluster.RAY_COORDINATOR_VARIABLE`; not imported from there, so
#: that starting a trainer imports no Keras on the driver).
COORDINATOR_VARIABLE = "KERAS_DIST_RAY_COORDINATOR_ADDRESS"
_KERAS_BACKENDS = ("jax", "torch", "tensorflow")


@dataclasses.dataclass
class KerasConfig(BackendConfig):
    """How the workers of a `KerasTrainer` join their keras_dist job.

    Args:
        keras_backend: `"jax"`, `"torch"` or `"tensorflow"`: set as
            `KERAS_BACKEND` on every worker before the training function
            runs, so it must not be imported there earlier. `KerasTrainer`
            defaults it to the driver's `KERAS_BACKEND`. None leaves the
            workers' own (`RunConfig(worker_runtime_env=...)`, else Keras'
            default). A worker whose `KERAS_BACKEND` is already another one
            fails with an error naming both.
    """

    keras_backend: str | None = None

    def __post_init__(self) -> None:
        if self.keras_backend is not None and self.keras_backend not in (
            _KERAS_BACKENDS
        ):
            raise ValueError(
                f"`keras_backend` must be one of {list(_KERAS_BACKENDS)} or None. "
                f"Received: keras_backend={self.keras_backend!r}"
            )

    @property
    def backend_cls(self) -> type[Backend]:
        return _KerasBackend

    def to_dict(self) -> dict[str, object]:
        return {"keras_backend": self.keras_backend}


def _node_address_and_free_port() -> tuple[str, int]:
    """Runs on the worker of world rank 0: this node's IP (the one Ray's other
    nodes reach it by) and a port nothing listens on now."""
    import ray  # noqa: PLC0415 (a Ray worker has it)

    host = ray.util.get_node_ip_address()
    return host, find_free_port("::" if ":" in host else "")


def _set_job_environment(coordinator: str, keras_backend: str | None) -> None:
    """Runs on every worker before the training function."""
    if keras_backend is not None:
        current = os.environ.get("KERAS_BACKEND")
        if current and current != keras_backend:
            raise ValueError(
                f"KerasTrainer runs keras_backend={keras_backend!r}, but this "
                f"worker's KERAS_BACKEND is {current!r} (from the runtime "
                "environment). Make them agree, or pass "
                "keras_config=KerasConfig(keras_backend=None) to keep the "
                "workers' own."
            )
        os.environ["KERAS_BACKEND"] = keras_backend
    os.environ[COORDINATOR_VARIABLE] = coordinator


class _KerasBackend(Backend):
    """Publishes the coordinator's address on every worker of the group."""

    def on_start(self, worker_group, backend_config: KerasConfig) -> None:
        host, port = worker_group.execute_single(0, _node_address_and_free_port)
        worker_group.execute(
            _set_job_environment,
            coordinator=join_address(host, port),
            keras_backend=backend_config.keras_backend,
        )
