"""The job directory `keras-dist launch` makes for each attempt, and the
variables it sets so that each rank finds it.

```
<temp dir>/keras_dist_job_<random>/    KERAS_DIST_JOB_DIR
    rank-<r>.pid                       its process id (the launcher writes it)
    rank-<r>.error.json                a rank's uncaught error (faults.lifecycle)
    rank-<r>.heartbeat.json            its step and phase (faults.heartbeat)
    tmp-<r>/                           its TMPDIR, removed with the directory
```
Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

# Where each rank finds the attempt's job directory: its error report, its
# heartbeat and its own temporary directory live there (see `job_paths`).
JOB_DIRECTORY_VARIABLE = "KERAS_DIST_JOB_DIR"

# Each rank's hang timeout (`--hang-timeout`; keras_dist.faults.hang_doctor).
HANG_TIMEOUT_VARIABLE = "KERAS_DIST_HANG_TIMEOUT"

# The launcher's pid: a rank ends when it is gone (see keras_dist.faults).
LAUNCHER_PID_VARIABLE = "KERAS_DIST_LAUNCHER_PID"

JOB_DIRECTORY_PREFIX = "keras_dist_job_"

# The exit status of every rank of a job that a preemption signal stopped
# after a `kd.Checkpoint` saved its state (EX_TEMPFAIL: "try again later").
PREEMPTED_EXIT_CODE = 75


@dataclasses.dataclass(frozen=True)
class RankPaths:
    """The files of one rank inside an attempt's job directory.

    Attributes:
        pid_file: the rank's process id, written by the launcher when it starts
            the rank: the other ranks see whether it still runs.
        error_file: where the rank writes its uncaught exception (JSON).
        heartbeat_file: where the rank writes its step and phase (JSON).
        temporary_directory: the rank's `TMPDIR`; removed with the job
            directory, so temporary files never outlive the job.
    """

    pid_file: str
    error_file: str
    heartbeat_file: str
    temporary_directory: str


def job_paths(job_directory: str, rank: int) -> RankPaths:
    """The paths of `rank`'s files in `job_directory` (the launcher and the
    ranks both use this, so they agree on the names)."""
    return RankPaths(
        pid_file=os.path.join(job_directory, f"rank-{rank}.pid"),
        error_file=os.path.join(job_directory, f"rank-{rank}.error.json"),
        heartbeat_file=os.path.join(job_directory, f"rank-{rank}.heartbeat.json"),
        temporary_directory=os.path.join(job_directory, f"tmp-{rank}"),
    )


def read_error_report(path: str) -> dict | None:
    """A rank's error report (written by `keras_dist.faults.lifecycle`), or
    None when there is none or it is unreadable."""
    try:
        with open(path) as file:
            report = json.load(file)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not isinstance(
        report.get("timestamp"), int | float
    ):
        return None
    return report


def read_error_reports(job_directory: str, ranks: list[int]) -> dict[int, dict]:
    """The error reports `ranks` wrote in `job_directory`, by rank (each with
    its `rank` as the launcher numbers it)."""
    reports = {}
    for rank in ranks:
        report = read_error_report(job_paths(job_directory, rank).error_file)
        if report is not None:
            reports[rank] = {**report, "rank": rank}
    return reports


def describe_error_report(report: dict) -> str:
    """`"rank 1 failed: ValueError: bad labels"` (the message's first line)."""
    return f"rank {report.get('rank')} failed: {describe_exception(report)}"


def describe_exception(report: dict) -> str:
    """`"ValueError: bad labels"`: the exception of an error report, with the
    first line of its message."""
    lines = str(report.get("message", "")).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > 300:
        message = message[:297] + "..."
    cause = str(report.get("type", "Exception"))
    if message:
        cause = f"{cause}: {message}"
    return cause


def reported_own_failure(report: dict) -> bool:
    """Whether the rank that wrote `report` failed on its own, so no other
    rank's failure caused it: the rank decides (`keras_dist.faults.
    own_failure`) and writes `on_its_own`; a report without it counts as
    False."""
    return report.get("on_its_own") is True


def write_rank_pid(job_directory: str, rank: int, pid: int) -> None:
    """Record `rank`'s process id in `job_directory` (complete or absent)."""
    path = job_paths(job_directory, rank).pid_file
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        file.write(str(pid))
    os.replace(temporary, path)


def read_rank_pids(job_directory: str) -> dict[int, int]:
    """The process id of every rank recorded in `job_directory`, by rank."""
    pids = {}
    try:
        names = os.listdir(job_directory)
    except OSError:
        return pids
    for name in names:
        rank, _, pid_suffix = name.removeprefix("rank-").partition(".")
        if not (name.startswith("rank-") and pid_suffix == "pid" and rank.isdigit()):
            continue
        try:
            with open(os.path.join(job_directory, name)) as file:
                pids[int(rank)] = int(file.read())
        except (OSError, ValueError):
            continue
    return pids


def remove_stale_job_directories() -> None:
    """Remove the job directories of launchers that died without removing
    theirs (SIGKILL): each name carries its launcher's pid."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(JOB_DIRECTORY_PREFIX) :].partition("_")[0]
        if not name.startswith(JOB_DIRECTORY_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except (PermissionError, OverflowError):
            continue  # alive (another user's), or not a pid
