"""The SLURM templates of `integrations/slurm/`, run on this machine.

There is no SLURM here. Each test runs a template file itself with bash, in
the environment `sbatch` gives a batch script (SLURM_JOB_ID, SLURM_NTASKS,
SLURM_JOB_NODELIST=localhost, ...), with stand-ins for SLURM's commands on
PATH (`tests/integrations/fake_slurm/`): `srun` starts the step's tasks as
local processes with the variables the real `srun` gives each task
(SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_TASKS,
SLURM_STEP_NODELIST, ...) and passes USR1 on to them as srun does; `scontrol`
expands host lists and records `requeue` calls. Everything else is real:
the template's shell code, `keras-dist launch`, `kd.initialize()`, the
training processes and their job. Not tested: a real SLURM (signal delivery
by slurmstepd, requeue by slurmctld), several nodes, GPUs.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_dist import cluster
from keras_dist.cluster import find_free_port
from tests.multiprocess import WORKERS
from tests.workers import cluster_scenario

# Backend-neutral tests run on one backend; the jobs say which backend trains.
pytestmark = pytest.mark.backend("torch")

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = REPOSITORY / "integrations" / "slurm"
PER_GPU = TEMPLATES / "per_gpu.sbatch"
PER_NODE = TEMPLATES / "per_node.sbatch"
FAKE_SLURM = pathlib.Path(__file__).parent / "fake_slurm"
JOB_ID = "4242"
TIMEOUT = 180


def batch_environment(tmp_path: pathlib.Path, *, ntasks: int, **extra) -> dict:
    """The environment of a batch script on one node, `localhost`, with
    `ntasks` tasks, as `sbatch` gives it; SLURM's commands are the
    stand-ins, Python and `keras-dist` this one's."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not (
            name in cluster.ENVIRONMENT_VARIABLES
            or name.startswith(("SLURM_", "KERAS_DIST", "PET_", "JAX_", "JOBSET_"))
        )
    }
    env.update(
        PATH=os.pathsep.join(
            [str(FAKE_SLURM), str(pathlib.Path(sys.executable).parent), env["PATH"]]
        ),
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOBID=JOB_ID,
        SLURM_JOB_NAME="keras-dist",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS=str(ntasks),
        SLURM_NPROCS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_TASKS_PER_NODE=str(ntasks),
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_SUBMIT_DIR=str(tmp_path),
        KERAS_DIST_COORDINATOR_PORT=str(find_free_port()),
        KERAS_DIST_INIT_TIMEOUT="60",
        FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    if env.get("KERAS_BACKEND") != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "1"
    env.update(extra)
    return env


def run_template(
    template: pathlib.Path, args: list[str], env: dict, tmp_path: pathlib.Path
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["bash", str(template), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    return result


def requeues(tmp_path: pathlib.Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def one_process_weights():
    """Plain Keras, one device, in this process."""
    return cluster_scenario.train(None)


def assert_trained_as_one_process(output: pathlib.Path, expected: list) -> list:
    results = [
        json.loads((output / f"result-{rank}.json").read_text()) for rank in (0, 1)
    ]
    assert [(r["processes"], r["rank"]) for r in results] == [(2, 0), (2, 1)]
    for result in results:
        for ours, reference in zip(result["weights"], expected, strict=True):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    return results


# -- training: the templates' commands form the job ------------------------------
@pytest.mark.backend("torch")
def test_per_gpu_template_forms_the_job_and_trains_as_one_process(
    tmp_path, one_process_weights
):
    """`srun python train.py`, 2 tasks: kd.initialize() reads the task's
    SLURM variables (SlurmEnvironment) and the job trains as one process."""
    env = batch_environment(tmp_path, ntasks=2)
    result = run_template(
        PER_GPU, [str(WORKERS / "cluster_worker.py"), str(tmp_path)], env, tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = assert_trained_as_one_process(tmp_path, one_process_weights)
    assert [r["detected"] for r in results] == ["SlurmEnvironment"] * 2
    port = env["KERAS_DIST_COORDINATOR_PORT"]
    assert [r["coordinator"] for r in results] == [f"localhost:{port}"] * 2
    assert requeues(tmp_path) == []  # a finished run is not requeued


@pytest.mark.backend("tensorflow")
def test_per_node_template_launches_and_trains_as_one_process(
    tmp_path, one_process_weights
):
    """`srun` one task, which runs `keras-dist launch --nproc-per-node 2` with
    the step's node count, node id and the head node from `scontrol show
    hostnames`: one job of 2 processes, trained as one process."""
    env = batch_environment(tmp_path, ntasks=1, NPROC_PER_NODE="2")
    result = run_template(
        PER_NODE, [str(WORKERS / "cluster_worker.py"), str(tmp_path)], env, tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    results = assert_trained_as_one_process(tmp_path, one_process_weights)
    # The launcher's coordinator is the template's: head node, job's port.
    port = env["KERAS_DIST_COORDINATOR_PORT"]
    assert [r["coordinator"] for r in results] == [f"localhost:{port}"] * 2
    assert requeues(tmp_path) == []


# -- preemption: USR1 to the batch script, exit 75, requeue -----------------------
WAIT_FOR_USR1 = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(75))
rank = os.environ.get("RANK") or os.environ["SLURM_PROCID"]
pathlib.Path(sys.argv[1], f"ready-{rank}").touch()
time.sleep(120)
sys.exit(3)  # no USR1 came
"""


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def preempt(template: pathlib.Path, env: dict, tmp_path: pathlib.Path, ranks: int):
    """Run `template` with tasks (or ranks) that exit 75 on USR1, once all
    are ready send USR1 to the batch script only, as `--signal=B:USR1@120`
    does; return its exit status and output."""
    script = tmp_path / "wait_for_usr1.py"
    script.write_text(WAIT_FOR_USR1)
    with open(tmp_path / "batch.log", "w") as log:
        batch = subprocess.Popen(
            ["bash", str(template), str(script), str(tmp_path)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ready = wait_until(
                lambda: (
                    len(list(tmp_path.glob("ready-*"))) == ranks
                    or batch.poll() is not None
                ),
                timeout=TIMEOUT,
            )
            assert ready and batch.poll() is None, (tmp_path / "batch.log").read_text()
            batch.send_signal(signal.SIGUSR1)
            batch.wait(timeout=60)
        finally:
            if batch.poll() is None:
                batch.kill()
                batch.wait(timeout=30)
    return batch.returncode, (tmp_path / "batch.log").read_text()


@pytest.mark.backend("torch")
def test_usr1_to_the_per_gpu_batch_script_reaches_the_tasks_and_requeues(tmp_path):
    env = batch_environment(tmp_path, ntasks=2)
    status, log = preempt(PER_GPU, env, tmp_path, ranks=2)
    assert status == 75, log
    assert "passing it to the training step" in log
    assert requeues(tmp_path) == [f"requeue {JOB_ID}"], log


@pytest.mark.backend("tensorflow")
def test_usr1_through_the_launcher_of_the_per_node_template_requeues(tmp_path):
    """srun passes USR1 to `keras-dist launch`, which passes it to its ranks
    and exits 75 when they did."""
    env = batch_environment(tmp_path, ntasks=1, NPROC_PER_NODE="2")
    status, log = preempt(PER_NODE, env, tmp_path, ranks=2)
    assert status == 75, log
    assert "was preempted" in log  # the launcher names the ranks' exit
    assert requeues(tmp_path) == [f"requeue {JOB_ID}"], log


# -- the requeue logic itself, with any step ----------------------------------------
def shell_functions(template: pathlib.Path) -> str:
    """The template's block of keras_dist shell functions."""
    match = re.search(
        r"^# ---- keras_dist: preemption.*?^# -{20,}$",
        template.read_text(),
        flags=re.MULTILINE | re.DOTALL,
    )
    assert match, f"{template} lost its keras_dist block"
    return match.group(0)


def test_the_templates_share_one_requeue_block():
    assert shell_functions(PER_GPU) == shell_functions(PER_NODE)


@pytest.mark.parametrize(
    ("step_status", "requeued"), [(0, False), (1, False), (75, True), (143, False)]
)
def test_only_exit_status_75_requeues(tmp_path, step_status, requeued):
    script = (
        shell_functions(PER_GPU)
        + f"\nkeras_dist_run_step bash -c 'exit {step_status}'\n"
        + "keras_dist_requeue_if_preempted $?\n"
    )
    result = subprocess.run(
        ["bash", "-c", script],
        env=batch_environment(tmp_path, ntasks=1),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == step_status, result.stderr
    assert requeues(tmp_path) == ([f"requeue {JOB_ID}"] if requeued else [])


def test_the_templates_ask_for_the_signal_and_the_requeue():
    for template in (PER_GPU, PER_NODE):
        text = template.read_text()
        assert "#SBATCH --signal=B:USR1@" in text
        assert "#SBATCH --requeue" in text
        assert text.count("keras_dist_requeue_if_preempted $?") == 1
