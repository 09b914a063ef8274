"""Start a real multi-process job on loopback for a test, and clean it up."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import subprocess
import time
from collections.abc import Callable
from typing import Any

from keras_dist.cluster import find_free_port
from tests.fork_server import start_python

WORKERS = pathlib.Path(__file__).parent / "workers"


def run_job(
    worker: str,
    args: list[str],
    *,
    processes: int,
    env: dict[str, str],
    output_dir: pathlib.Path,
    timeout: float = 240.0,
    allow_failures: bool = False,
) -> list[dict]:
    """Run `processes` copies of `workers/<worker>`; return each one's JSON.

    Each process runs as `python workers/<worker> ARGS... OUTPUT` would, forked
    from a process that has imported Keras and the backend when its
    environment allows (`tests/fork_server.py`: the imports cost seconds).

    With `allow_failures`, return each process' exit code and log instead.

    Each process gets its rank through the KERAS_DISTRIBUTION_* variables and
    writes its result to `output_dir/result-<rank>.json`. Every process is
    killed on timeout or failure, and the error shows their output.
    """
    port = find_free_port()
    output_dir.mkdir(parents=True, exist_ok=True)
    children = []
    for rank in range(processes):
        child_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")},
            **env,
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(processes),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
            "KERAS_DIST_INIT_TIMEOUT": "60",
        }
        output = output_dir / f"result-{rank}.json"
        child = start_python(
            [WORKERS / worker, *args, output],
            env=child_env,
            output=output_dir / f"log-{rank}.txt",
        )
        children.append((child, None))
    wait_then_clean_up(children, timeout)
    failures = [rank for rank, (child, _) in enumerate(children) if child.returncode]
    if allow_failures:
        return [
            {"returncode": child.returncode, "log": log_of(output_dir, rank)}
            for rank, (child, _) in enumerate(children)
        ]
    if failures:
        logs = "\n".join(
            f"--- rank {rank} (exit {children[rank][0].returncode}) ---\n"
            + (output_dir / f"log-{rank}.txt").read_text()[-4000:]
            for rank in failures
        )
        raise AssertionError(f"ranks {failures} failed:\n{logs}")
    return [
        json.loads((output_dir / f"result-{rank}.json").read_text())
        for rank in range(processes)
    ]


def wait_then_clean_up(children: list, timeout: float) -> None:
    """Wait up to `timeout` s for every `(process, log)` of `children`; kill
    those still running and close the logs."""
    deadline = time.monotonic() + timeout
    try:
        for child, _ in children:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for child, log in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            if log is not None:
                log.close()


def log_of(output_dir: pathlib.Path, rank: int) -> str:
    return (output_dir / f"log-{rank}.txt").read_text()


def assert_each_sample_once_per_epoch(results: list[dict], samples: int) -> None:
    """Every id in `range(samples)` reached exactly one process, each epoch."""
    for epoch in range(len(results[0]["ids"])):
        per_process = [result["ids"][epoch] for result in results]
        assert all(per_process), "every process trains on some samples"
        seen = [sample for ids in per_process for sample in ids]
        assert len(seen) == len(set(seen)), "no sample twice"
        assert sorted(seen) == list(map(float, range(samples)))


def assert_each_input_type_once_per_epoch(results: list[dict], samples: int) -> None:
    """`assert_each_sample_once_per_epoch` for each input type of a job that
    read them all in turn (`ids_by_kind`: arrays, tf.data, a PyDataset, a
    DataLoader, a generator)."""
    kinds = results[0]["ids_by_kind"]
    assert list(kinds) == [
        "numpy",
        "tf_data",
        "py_dataset",
        "torch_loader",
        "generator",
    ]
    for kind in kinds:
        per_process = [{"ids": result["ids_by_kind"][kind]} for result in results]
        assert_each_sample_once_per_epoch(per_process, samples)


def assert_own_data_parity(results: list[dict], reference: dict) -> None:
    """Processes that fed their own data trained like the one-process run."""
    import numpy as np  # noqa: PLC0415

    for result in results:
        for ours, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        for key, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        assert result["predictions_match"]
    assert [r["rows"] for r in results] == [19, 18]


def once_per_run(tmp_path_factory, name: str, compute: Callable[[pathlib.Path], Any]):
    """`compute(directory)` once per test run, by whichever xdist worker asks
    first; a worker asking later waits for it and reads its result (JSON).

    For the module fixtures that start jobs: xdist may give a module's tests to
    both workers (a steal can split a module), and each worker would run the
    job again. `directory` is shared by the workers (the run's base
    temporary directory); the result must be JSON (lists come back for tuples).
    """
    directory = once_directory(tmp_path_factory, name)
    with open(directory.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = directory / "result.json"
        if done.exists():
            return json.loads(done.read_text())
        directory.mkdir(exist_ok=True)
        result = compute(directory)
        done.write_text(json.dumps(result))
        return result


def run_job_once(
    tmp_path_factory, name: str, worker: str, args: list[str], **options
) -> tuple[list[dict], pathlib.Path]:
    """`run_job(worker, args, **options)` once per test run (`once_per_run`):
    each process' JSON, and the job's output directory (its logs)."""
    results = once_per_run(
        tmp_path_factory,
        name,
        lambda directory: run_job(worker, args, output_dir=directory, **options),
    )
    return results, once_directory(tmp_path_factory, name)


def once_directory(tmp_path_factory, name: str) -> pathlib.Path:
    """The directory `once_per_run(..., name, ...)` gives its computation."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's, above each worker's own
    return root / f"once-{name}"
