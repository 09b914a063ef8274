"""Never alone by mistake: a process that a launcher or a cluster started as
one of several, but that never called `keras_dist.initialize()`, is stopped
before it trains or writes anything.

Without the check each such process would be a job of one: rank 0 of 1,
training on the whole data set alone, every one of them believing it is the
writer of checkpoints and saved models. keras_dist does not join the job for
the user at that point, on any backend, because it is too late to do it
right:

- JAX starts its distributed runtime only before its first computation
  (`jax.distributed.initialize()`), and TensorFlow its collectives only before
  its first op; by the time `fit` starts, the model's variables exist.
- On every backend the distribution was already built from the devices of
  this process alone (`kd.DataParallel()` lists them when it is made), and
  whatever the script asked before (`kd.process_id()`, `kd.num_processes()`)
  was answered as if the process were alone.

So the same script fails the same way on every backend, before the first
step, with an error that names the rank, the variables that describe the
job, and the fix: `kd.initialize()` at the start of the script.
"""

from __future__ import annotations

import os

from keras_dist.backends import get_adapter
from keras_dist.cluster.job_dir import LAUNCHER_PID_VARIABLE
from keras_dist.cluster.resolve import NUM_PROCESSES_VARIABLE, resolve_job
from keras_dist.common import job

_WHERE = (
    "at the start of the script, right after `import keras_dist as kd` and "
    "before building a model, a distribution or anything else of the backend "
    "(JAX and TensorFlow can join a job only before their first computation, "
    "so keras_dist does not join it for you this late)"
)


def require_joined(action: str) -> None:
    """Raise unless this process may run `action` (say `"fit"`): it joined a
    job through `keras_dist.initialize()` (or the backend's own), or nothing
    says it is one of several processes.

    Raises:
        RuntimeError: the environment (`keras-dist launch`, torchrun, SLURM,
            `TF_CONFIG`, `KERAS_DISTRIBUTION_*`...) describes a job of several
            processes, or describes one that cannot be read, and
            `keras_dist.initialize()` was not called; the message names this
            process' rank, the variables and the fix.
    """
    if job.initialize_called() or get_adapter().num_processes() > 1:
        return
    try:
        found = resolve_job()
    except (TypeError, ValueError) as error:
        raise RuntimeError(
            f"keras_dist will not run {action} in this process alone: its "
            f"environment describes a cluster job that cannot be read ({error}), "
            "and `kd.initialize()` was never called. Fix those variables and "
            f"call `kd.initialize()` {_WHERE}; or unset them to run this process "
            "alone."
        ) from error
    if found.count == 1:
        return
    launcher = (
        ", set by `keras-dist launch`" if os.environ.get(LAUNCHER_PID_VARIABLE) else ""
    )
    sources = ", ".join(
        dict.fromkeys(_shown(name) for name in (found.count_source, found.rank_source))
    )
    raise RuntimeError(
        f"Rank {found.rank} of {found.count} never joined its job: this process "
        f"was started as rank {found.rank} of a job of {found.count} processes "
        f"({sources}{launcher}), but `kd.initialize()` was never called, so "
        f"keras_dist would run {action} here alone, on all the data, and every "
        "process would write files as process 0. Call `kd.initialize()` "
        f"(`keras_dist.initialize()`) {_WHERE}. To run this process alone on "
        f"purpose, start it outside the job or set {NUM_PROCESSES_VARIABLE}=1 "
        "in its environment."
    )


def _shown(source: str) -> str:
    """`NAME='value'` for a variable that is set and short, else `source` as
    it is (a long `TF_CONFIG`, or a source that is no variable)."""
    value = os.environ.get(source)
    if value is None or len(value) > 60:
        return source
    return f"{source}={value!r}"
