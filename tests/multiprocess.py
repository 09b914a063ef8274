"""Start a real multi-process job on loopback for a test, and clean it up."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

WORKERS = pathlib.Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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

    With `allow_failures`, return each process' exit code and log instead.

    Each process gets its rank through the KERAS_DISTRIBUTION_* variables and
    writes its result to `output_dir/result-<rank>.json`. Every process is
    killed on timeout or failure, and the error shows their output.
    """
    port = free_port()
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
        log = open(output_dir / f"log-{rank}.txt", "w")
        output = output_dir / f"result-{rank}.json"
        command = [sys.executable, str(WORKERS / worker), *args, str(output)]
        children.append(
            (subprocess.Popen(command, env=child_env, stdout=log, stderr=log), log)
        )
    deadline = time.monotonic() + timeout
    try:
        for child, _ in children:
            remaining = max(1.0, deadline - time.monotonic())
            child.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for child, log in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            log.close()
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


def log_of(output_dir: pathlib.Path, rank: int) -> str:
    return (output_dir / f"log-{rank}.txt").read_text()
