"""Who launched this process and how a job comes together: standard library
only, so that the launcher starts without Keras or a backend.

`environments` (the cluster environments and their detection), `addresses`
(`host:port`, free ports), `launcher` (`keras-dist launch`), `rank_output`
(its ranks' output, labelled after a failure), `job_dir` (the
job directory and the variables the launcher sets), `hang_doctor` (naming the
ranks a stalled job waits for), `roll_call` (every process checks in at the
coordinator), `rendezvous` (every process' address for TensorFlow) and
`json_lines` (what they say to each other).
"""

from keras_dist.cluster.addresses import find_free_port, join_address, split_address
from keras_dist.cluster.environments import (
    CLUSTER_ENVIRONMENTS,
    ENVIRONMENT_VARIABLES,
    RAY_COORDINATOR_VARIABLE,
    CloudTpuEnvironment,
    ClusterEnvironment,
    JaxEnvironment,
    JobSetEnvironment,
    KubeflowTorchEnvironment,
    RayEnvironment,
    SlurmEnvironment,
    TFConfigEnvironment,
    TorchrunEnvironment,
    detect_cluster,
    environment_int,
    environment_value,
    explain_detection,
)
from keras_dist.cluster.hostlist import expand_hostlist

__all__ = [
    "CLUSTER_ENVIRONMENTS",
    "ENVIRONMENT_VARIABLES",
    "RAY_COORDINATOR_VARIABLE",
    "CloudTpuEnvironment",
    "ClusterEnvironment",
    "JaxEnvironment",
    "JobSetEnvironment",
    "KubeflowTorchEnvironment",
    "RayEnvironment",
    "SlurmEnvironment",
    "TFConfigEnvironment",
    "TorchrunEnvironment",
    "detect_cluster",
    "environment_int",
    "environment_value",
    "expand_hostlist",
    "explain_detection",
    "find_free_port",
    "join_address",
    "split_address",
]
