"""Which cluster environment launched this process (`detect_cluster`), and
what each one sees (`explain_detection`, for `keras-dist env`)."""

from __future__ import annotations

import os

from keras_dist.cluster.environments.base import (
    ClusterEnvironment,
    environment_value,
)
from keras_dist.cluster.environments.cloud_tpu import CloudTpuEnvironment
from keras_dist.cluster.environments.kubernetes import (
    JaxEnvironment,
    JobSetEnvironment,
    KubeflowTorchEnvironment,
)
from keras_dist.cluster.environments.ray_train import RayEnvironment
from keras_dist.cluster.environments.slurm import SlurmEnvironment
from keras_dist.cluster.environments.tf_config import TFConfigEnvironment
from keras_dist.cluster.environments.torchrun import TorchrunEnvironment

#: The environments `detect_cluster` tries, in order.
CLUSTER_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    RayEnvironment,
    TorchrunEnvironment,
    SlurmEnvironment,
    JaxEnvironment,
    KubeflowTorchEnvironment,
    CloudTpuEnvironment,
    JobSetEnvironment,
    TFConfigEnvironment,
)


def detect_cluster() -> ClusterEnvironment | None:
    """The first environment of `CLUSTER_ENVIRONMENTS` whose variables are set.

    Returns:
        An instance of it, or None when this process was not started by a
        known launcher.

    Example:

    >>> cluster = detect_cluster()  # rank 1 of `torchrun --nproc-per-node 2`
    >>> cluster.coordinator_address(), cluster.num_processes(), cluster.process_id()
    ('127.0.0.1:29500', 2, 1)
    """
    for environment in CLUSTER_ENVIRONMENTS:
        if environment.detect():
            return environment()
    return None


def explain_detection() -> list[dict[str, object]]:
    """What `detect_cluster` sees, for `keras-dist env`: every environment of
    `CLUSTER_ENVIRONMENTS` in the order they are tried, whether its
    `detect()` said yes, and which of the variables it reads are set.

    Returns:
        One dict per environment: `name`, `detected` (bool), `chosen` (the
        first detected one, the one `detect_cluster` returns), `summary`
        (its docstring's first line) and `set` (`{variable: value}`).
    """
    explained: list[dict[str, object]] = []
    chosen = False
    for environment in CLUSTER_ENVIRONMENTS:
        detected = bool(environment.detect())
        variables = getattr(environment, "variables", ())
        explained.append(
            {
                "name": environment.__name__,
                "detected": detected,
                "chosen": detected and not chosen,
                "summary": " ".join(
                    (environment.__doc__ or "").strip().split("\n\n")[0].split()
                ),
                "reads": list(variables),
                "set": {
                    name: os.environ[name]
                    for name in variables
                    if environment_value(name) is not None
                },
            }
        )
        chosen = chosen or detected
    return explained
