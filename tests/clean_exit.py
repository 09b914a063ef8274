"""Run a training script as real processes and check that each ends cleanly.

A script that trained correctly must also exit with 0: a process aborted in
the interpreter's teardown (SIGABRT, exit code 134, "terminate called ...
FATAL: exception not rethrown") is a failed job to a launcher, a scheduler or
CI. The abort is timing-dependent (more frequent on a busy machine), so the
suite runs the script a few times (`tests/test_clean_exit.py`) and the stress
mode runs it many times, several at once (outside CI):

    python tests/clean_exit.py --backend tensorflow --runs 24 --parallel 4

Each run starts fresh interpreters (never forked from a warm one): the
teardown is what is checked. PyTorch runs a job of 2 processes; JAX and
TensorFlow one process with several CPU devices.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from keras_dist.cluster import find_free_port

WORKER = pathlib.Path(__file__).parent / "workers" / "clean_exit_worker.py"
# What a process that aborts in its teardown leaves in its output.
ABORT_SIGNS = ("terminate called", "Fatal Python error", "Aborted")
_BACKEND_ENV = {
    "jax": {"KERAS_DIST_CPU_DEVICES": "8"},
    "tensorflow": {"KERAS_DIST_CPU_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "2"},
    "torch": {},
}
PROCESSES = {"jax": 1, "tensorflow": 1, "torch": 2}


def run_once(backend: str, timeout: float = 300.0) -> list[str]:
    """Run the worker once as a job of `PROCESSES[backend]` processes; return
    one line per process that did not end cleanly (empty: all did)."""
    processes = PROCESSES[backend]
    port = find_free_port()
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")},
        **_BACKEND_ENV[backend],
        "KERAS_BACKEND": backend,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    problems = []
    with tempfile.TemporaryDirectory(prefix="keras_dist_exit_") as directory:
        children = []
        for rank in range(processes):
            env = dict(base)
            if processes > 1:
                env.update(
                    KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                    KERAS_DISTRIBUTION_NUM_PROCESSES=str(processes),
                    KERAS_DISTRIBUTION_PROCESS_ID=str(rank),
                    KERAS_DIST_INIT_TIMEOUT="60",
                )
            children.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), os.path.join(directory, "ckpt")],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        for rank, child in enumerate(children):
            try:
                out, err = child.communicate(
                    timeout=max(1.0, deadline - time.monotonic())
                )
            except subprocess.TimeoutExpired:
                for other in children:
                    other.kill()
                out, err = child.communicate()
                problems.append(f"rank {rank}: still running after {timeout} s")
                continue
            signs = [sign for sign in ABORT_SIGNS if sign in err]
            if child.returncode != 0 or signs or "trained" not in out:
                problems.append(
                    f"rank {rank}: exit code {child.returncode}, {signs or ''}\n"
                    f"{err[-3000:]}"
                )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(PROCESSES), required=True)
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--parallel", type=int, default=4)
    arguments = parser.parse_args()
    with concurrent.futures.ThreadPoolExecutor(arguments.parallel) as pool:
        results = list(
            pool.map(lambda _: run_once(arguments.backend), range(arguments.runs))
        )
    failed = [problems for problems in results if problems]
    for problems in failed:
        print("\n".join(problems), file=sys.stderr)
    print(
        f"{arguments.backend}: {len(failed)} of {arguments.runs} runs did not end "
        f"cleanly ({arguments.parallel} at once)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
