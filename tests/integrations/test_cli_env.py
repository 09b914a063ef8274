"""`keras-dist env`: which cluster environment `kd.initialize()` detects, from
which variables, and the job it would join; errors in the variables exit 2.

Backend-neutral, so one backend runs it. `python -m keras_dist env` runs as
a subprocess in an `srun` task's environment (a subprocess imports keras and a
backend: seconds); the other cases, errors included, call the same
`keras_dist.cli.main` in this process (`python -m keras_dist` exits with what
it returns).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keras_dist import cli, cluster

pytestmark = pytest.mark.backend("torch")


def clean_environment() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if not (
            name in cluster.ENVIRONMENT_VARIABLES
            or name.startswith(("SLURM_", "KERAS_DISTRIBUTION_", "PET_", "JAX_"))
            or name.startswith(("JOBSET_", "KERAS_DIST_COORDINATOR"))
        )
    }


SRUN_TASK = {  # task 1 of `srun -N 2 -n 4` on node[07-08]
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-08]",
}


def test_python_m_keras_dist_env_in_an_srun_task():
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", "env", "--json"],
        env={**clean_environment(), **SRUN_TASK},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["detected"] == "SlurmEnvironment"
    assert report["cluster"] == {
        "coordinator": "node07:12355",
        "num_processes": 4,
        "num_processes_from": "SLURM_STEP_NUM_TASKS",
        "process_id": 1,
        "process_id_from": "SLURM_PROCID",
        "local_process_id": 1,
    }
    assert report["job"] == {
        "coordinator": "node07:12355",
        "num_processes": 4,
        "process_id": 1,
    }
    tried = {entry["name"]: entry for entry in report["tried"]}
    assert tried["SlurmEnvironment"]["set"]["SLURM_STEP_NODELIST"] == "node[07-08]"


@pytest.fixture
def run_env(monkeypatch, capsys):
    """`keras-dist env` in this process, in a clean environment plus the
    given variables; returns (exit status, stdout, stderr)."""
    for name in list(os.environ):
        if name not in clean_environment():
            monkeypatch.delenv(name)

    def run(variables: dict[str, str], *arguments: str):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        status = cli.main(["env", *arguments])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def test_alone_in_the_detection_order(run_env):
    status, out, _ = run_env({}, "--json")
    report = json.loads(out)
    assert status == 0
    assert [entry["name"] for entry in report["tried"]] == [
        environment.__name__ for environment in cluster.CLUSTER_ENVIRONMENTS
    ]
    assert report["detected"] is None
    assert not any(entry["detected"] for entry in report["tried"])
    assert report["job"] == {"coordinator": None, "num_processes": 1, "process_id": 0}


def test_alone_says_so(run_env):
    status, out, _ = run_env({})
    assert status == 0
    assert "No cluster environment detected" in out
    assert "this one is process 0, coordinator none (one process)" in out


def test_the_text_names_the_environment_the_variables_and_the_job(run_env):
    status, out, _ = run_env(SRUN_TASK)
    assert status == 0
    assert "SlurmEnvironment: DETECTED" in out
    assert "SLURM_PROCID='1'" in out
    assert "num_processes: 4 (from SLURM_STEP_NUM_TASKS)" in out
    assert (
        "Job keras_dist.initialize() joins: 4 process(es), this one is process 1, "
        "coordinator node07:12355"
    ) in out
    lines = out.splitlines()
    numbered = [line for line in lines if line.startswith("  ") and ". " in line[:6]]
    assert len(numbered) == len(cluster.CLUSTER_ENVIRONMENTS)


def test_the_first_detected_wins_and_the_others_are_named(run_env):
    # `srun torchrun ...`: both are set, torchrun's describe the processes.
    variables = {
        **SRUN_TASK,
        "RANK": "5",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": "29500",
    }
    status, out, _ = run_env(variables)
    assert status == 0
    assert "TorchrunEnvironment: DETECTED" in out
    assert "SlurmEnvironment: detected too, not used (an earlier one wins)" in out


def test_overrides_are_shown_and_win(run_env):
    status, out, _ = run_env(
        {**SRUN_TASK, "KERAS_DISTRIBUTION_NUM_PROCESSES": "1"}, "--json"
    )
    report = json.loads(out)
    assert status == 0
    assert report["overrides"]["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "1"
    assert report["cluster"]["num_processes"] == 4  # what the cluster says
    assert report["job"]["num_processes"] == 1  # what initialize() does


@pytest.mark.parametrize(
    ("variables", "detected", "coordinator", "rank"),
    [
        (
            {
                "JAX_COORDINATOR_ADDRESS": "tj-node-0-0.tj:29500",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "1",
            },
            "JaxEnvironment",
            "tj-node-0-0.tj:29500",
            1,
        ),
        (
            {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "tj-node-0-0.tj",
                "PET_MASTER_PORT": "29500",
            },
            "KubeflowTorchEnvironment",
            "tj-node-0-0.tj:29500",
            1,
        ),
        (
            {
                "JOBSET_COORDINATOR": "js-workers-0-0.js",
                "JOBSET_GLOBAL_REPLICAS": "2",
                "JOBSET_JOB_GLOBAL_INDEX": "1",
                "JOB_COMPLETION_INDEX": "0",
            },
            "JobSetEnvironment",
            "js-workers-0-0.js:12355",
            1,
        ),
    ],
    ids=["kubeflow-jax", "kubeflow-torch", "jobset"],
)
def test_kubernetes_environments(run_env, variables, detected, coordinator, rank):
    status, out, _ = run_env(variables, "--json")
    report = json.loads(out)
    assert status == 0, report
    assert report["detected"] == detected
    assert report["job"] == {
        "coordinator": coordinator,
        "num_processes": 2,
        "process_id": rank,
    }


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "auto"}
            | {"PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "29500"},
            "PET_NPROC_PER_NODE='auto' asks for that many processes per pod",
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "JAX_COORDINATOR_ADDRESS is missing",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2"}
            | {"JAX_PROCESS_ID": "0"},
            "JAX_COORDINATOR_ADDRESS must be 'host:port'",
        ),
        (
            {"JOBSET_COORDINATOR": "c", "JOBSET_GLOBAL_REPLICAS": "2"}
            | {"JOBSET_JOB_GLOBAL_INDEX": "0", "JOB_COMPLETION_INDEX": "1"},
            "this pod is pod 1 of its Job",
        ),
        (
            {"JOBSET_COORDINATOR": "c", "JOBSET_GLOBAL_REPLICAS": "2"}
            | {"JOBSET_JOB_GLOBAL_INDEX": "2"},
            "JOBSET_JOB_GLOBAL_INDEX must be in [0, JOBSET_GLOBAL_REPLICAS - 1]",
        ),
        (
            {**SRUN_TASK, "SLURM_LOCALID": "-1"},
            "SLURM_LOCALID must not be negative",
        ),
        (
            {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
            "torchrun-style variables are incomplete",
        ),
    ],
    ids=[
        "pet-nproc",
        "jax-incomplete",
        "jax-address",
        "jobset-pod",
        "jobset-rank",
        "slurm-localid",
        "torchrun-incomplete",
    ],
)
def test_errors_exit_2_with_the_message(run_env, variables, message):
    status, out, err = run_env(variables)
    assert status == 2
    assert message in err
    assert err.startswith("keras-dist env: ")
    assert "Cluster environments, in the order" in out  # what was tried, still


def test_srun_preserve_env_counts_the_step_tasks(run_env):
    # `srun -E -n 2` inside an allocation of 8 tasks keeps SLURM_NTASKS=8.
    status, out, _ = run_env({**SRUN_TASK, "SLURM_NTASKS": "8"}, "--json")
    report = json.loads(out)
    assert status == 0
    assert report["job"]["num_processes"] == 4


def test_srun_preserve_env_without_ntasks_still_detects_the_task(run_env):
    variables = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_NTASKS"}
    status, out, _ = run_env(variables, "--json")
    assert status == 0
    assert json.loads(out)["detected"] == "SlurmEnvironment"
