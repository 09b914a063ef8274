"""Cluster environments: who launched this process, and where is process 0?

`keras_dist.initialize()` called without arguments asks, in this order:

1. its explicit arguments (`job_addresses`, `num_processes`, `process_id`);
2. `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES` and
   `KERAS_DISTRIBUTION_PROCESS_ID` (what `keras-dist launch` sets);
3. the first cluster environment below whose `detect()` says its variables
   are present:

   - `TorchrunEnvironment`: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
     `MASTER_PORT` (and `LOCAL_RANK`), set by torchrun and most launchers
     that imitate it;
   - `SlurmEnvironment`: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else
     `SLURM_NTASKS`) and the node list of an `srun` task;
   - `JaxEnvironment`: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
     `JAX_PROCESS_ID` (Kubeflow Trainer's JAX runtime);
   - `KubeflowTorchEnvironment`: torchrun's `PET_NNODES`, `PET_NODE_RANK`,
     `PET_MASTER_ADDR`, `PET_MASTER_PORT` without torchrun (Kubeflow
     Trainer's torch runtime, one process per pod);
   - `CloudTpuEnvironment`: a Cloud TPU slice's `TPU_WORKER_HOSTNAMES` (or
     `TPU_PROCESS_ADDRESSES`), `TPU_WORKER_ID` and, for several slices,
     `MEGASCALE_*` (what JAX's Cloud TPU detection reads on GKE);
   - `JobSetEnvironment`: JobSet's coordinator, global-replicas and
     job-global-index annotations, projected into `JOBSET_*` variables;
   - `TFConfigEnvironment`: the `TF_CONFIG` JSON of TensorFlow clusters
     (Kubeflow TFJob, Vertex AI).

`RayEnvironment` (a Ray Train worker started by `keras_dist_ray.KerasTrainer`)
is asked before all of them: its signal is a live Ray Train worker context in
this very process, while the others' variables may be inherited by every Ray
worker from the environment its Ray node was started in (`srun ray start`
puts `SLURM_PROCID` into every worker) or set by another Ray trainer
(Ray's `TorchTrainer` sets `RANK` and `MASTER_ADDR`).

Levels 1 and 2 fill the three values one by one, and a value they give wins
over the cluster's even when the two disagree: `KERAS_DISTRIBUTION_NUM_PROCESSES=2`
inside an 8-task SLURM step makes a job of 2 processes, and tasks whose
`SLURM_PROCID` is 2 or more then fail with an error naming both values. The
cluster is only consulted for what levels 1 and 2 leave open.

torchrun comes before SLURM because `srun torchrun ...` sets both, and then
torchrun's `RANK`/`WORLD_SIZE` describe the training processes while the SLURM
variables describe the torchrun launchers. The Kubernetes ones follow SLURM
(a pod is no SLURM task, and a SLURM task that inherited Kubernetes variables
is one): the JAX runtime's `JAX_*` name the job outright; `PET_*` come after
torchrun, whose processes inherit them from their torchrun; JobSet's
annotations come after both, because a Kubeflow TrainJob is itself a JobSet
and its runtime's variables are the specific ones; a Cloud TPU worker's
variables come before JobSet's too: a TPU slice runs as one Job of several
pods (one a host), which JobSet's annotations cannot number. `TF_CONFIG`
comes last: it is the least specific, and stale copies of it are common in
notebooks.

Variables that are present but incomplete or inconsistent are an error naming
them and their values, never a silent single-process run.
"""

from keras_dist.cluster.environments.base import (
    ENVIRONMENT_VARIABLES,
    RAY_COORDINATOR_VARIABLE,
    ClusterEnvironment,
    environment_int,
    environment_value,
)
from keras_dist.cluster.environments.cloud_tpu import CloudTpuEnvironment
from keras_dist.cluster.environments.detection import (
    CLUSTER_ENVIRONMENTS,
    detect_cluster,
    explain_detection,
)
from keras_dist.cluster.environments.kubernetes import (
    JaxEnvironment,
    JobSetEnvironment,
    KubeflowTorchEnvironment,
)
from keras_dist.cluster.environments.ray_train import RayEnvironment
from keras_dist.cluster.environments.slurm import SlurmEnvironment
from keras_dist.cluster.environments.tf_config import TFConfigEnvironment
from keras_dist.cluster.environments.torchrun import TorchrunEnvironment

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
    "explain_detection",
]
