"""The hang doctor: when a job stops advancing, name the rank(s) it waits for.

Each process of a job keeps a heartbeat (`keras_dist.faults.heartbeat`): a
small JSON file saying which Keras call it is in, its epoch and step, its
phase (`data`, `step`, `callback`, `save`; `outside` when no keras_dist call
runs, which is not monitored) and when it last advanced. When a monitored rank
has not advanced for its hang timeout, every rank dumps its Python stacks (and
on torch the collective trace of its Flight Recorder), one summary names the
ranks behind and the job ends with `HANG_EXIT_CODE`.

The ranks behind are those with the least progress (every rank goes through
the same calls, epochs and steps in the same order); among equals, a rank in
its own code (a callback, a save, outside keras_dist) is named before one
reading data, and that one before a rank waiting inside a step (whose
collectives wait for the others).

This module uses only the standard library: `keras-dist launch` runs it, and
each rank's watchdog (`keras_dist.faults.heartbeat`) when there is no launcher.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping

from keras_dist.cluster.job_dir import HANG_TIMEOUT_VARIABLE

# As torch's NCCL watchdog: long enough for a first compilation or a large
# checkpoint, short enough that a hung job does not hold its machines all day.
DEFAULT_HANG_TIMEOUT_SECONDS = 1800.0
# As `timeout(1)`: the job ran out of time, it did not fail by itself.
HANG_EXIT_CODE = 124
MONITORED_PHASES = ("data", "step", "callback", "save")
# Which phase is named first among ranks of equal progress (lowest first).
_BLAME = {"outside": 0, "callback": 0, "save": 0, "data": 1, "step": 2}
# How long the launcher waits for every rank to dump its stacks.
DUMP_WAIT_SECONDS = 5.0
_CHECK_INTERVAL_SECONDS = 0.25


def check_hang_timeout(value: object, name: str = "hang_timeout") -> float:
    """`value` as seconds: a number >= 0, where 0 disables the hang doctor.

    Raises:
        TypeError: for anything but an int or a float.
        ValueError: for a negative, infinite or NaN number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"`{name}` must be a number of seconds (0 disables the hang doctor). "
            f"Received: {name}={value!r}"
        )
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(
            f"`{name}` must be a finite number of seconds >= 0 (0 disables the "
            f"hang doctor). Received: {name}={value!r}"
        )
    return seconds


def hang_timeout_from_environment(environ: Mapping[str, str] | None = None) -> float:
    """`KERAS_DIST_HANG_TIMEOUT` as seconds, or the default of 1800 when unset.

    Raises:
        ValueError: naming the variable's value when it is not a finite
            number >= 0 (`"nan"`, `"-1"`, `"soon"`).
    """
    raw = (os.environ if environ is None else environ).get(HANG_TIMEOUT_VARIABLE, "")
    if not raw.strip():
        return DEFAULT_HANG_TIMEOUT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(
            f"{HANG_TIMEOUT_VARIABLE} must be a number of seconds >= 0 (0 disables "
            f"the hang doctor). Received: {HANG_TIMEOUT_VARIABLE}={raw!r}"
        )
    return seconds


def dump_request_file(job_directory: str) -> str:
    """The file whose appearance asks every rank of the job to dump its stacks."""
    return os.path.join(job_directory, "hang-dump.request")


def read_heartbeat(path: str) -> dict | None:
    """A rank's heartbeat, or None when there is none (yet) or it is unreadable."""
    try:
        with open(path) as file:
            beat = json.load(file)
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) and "rank" in beat else None


def write_heartbeat(path: str, beat: dict) -> None:
    """Write `beat` to `path` whole: to a temporary name, then renamed over it,
    so that a reader never sees half a file."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        json.dump(beat, file)
    os.replace(temporary, path)


def is_monitored(beat: dict) -> bool:
    return beat.get("phase") in MONITORED_PHASES and beat.get("hang_timeout", 0) > 0


def idle_seconds(beat: dict, now: float) -> float:
    """Seconds since the rank last advanced (`now` and the beat: `time.time()`)."""
    return max(0.0, now - float(beat.get("advanced_at", now)))


def stalled(beats: list[dict], now: float) -> list[dict]:
    """The monitored beats that have not advanced for their hang timeout."""
    return [
        beat
        for beat in beats
        if is_monitored(beat) and idle_seconds(beat, now) > beat["hang_timeout"]
    ]


def ranks_behind(beats: list[dict]) -> list[dict]:
    """The beats of the ranks the others wait for (see the module's doc)."""
    if not beats:
        return []
    least = min(beat.get("progress", 0) for beat in beats)
    behind = [beat for beat in beats if beat.get("progress", 0) == least]
    blame = min(_BLAME.get(beat.get("phase"), 0) for beat in behind)
    return [beat for beat in behind if _BLAME.get(beat.get("phase"), 0) == blame]


def describe(beat: dict, now: float) -> str:
    """`"rank 1: fit (call 1), epoch 0, step 3, phase 'callback', no progress
    for 6.2 s"`; `step` counts the steps the call has completed."""
    where = []
    if beat.get("mode"):
        where.append(f"{beat['mode']} (call {beat.get('call', 0)})")
    if beat.get("epoch") is not None:
        where.append(f"epoch {beat['epoch']}")
    if beat.get("mode"):
        where.append(f"step {beat.get('step', 0)}")
    where.append(f"phase {beat.get('phase')!r}")
    where.append(f"no progress for {idle_seconds(beat, now):.1f} s")
    return f"rank {beat['rank']}: " + ", ".join(where)


def summary(beats: list[dict], now: float, *, world_size: int | None = None) -> str:
    """The hang doctor's report: the ranks behind first, then every rank seen."""
    beats = sorted(beats, key=lambda beat: beat["rank"])
    behind = ranks_behind(beats)
    names = ", ".join(str(beat["rank"]) for beat in behind)
    timeouts = sorted({beat.get("hang_timeout", 0) for beat in stalled(beats, now)})
    timeout = "/".join(f"{value:g}" for value in timeouts) or "?"
    lines = [
        f"hang detected: a rank made no progress for its hang timeout ({timeout} s, "
        f"--hang-timeout or {HANG_TIMEOUT_VARIABLE}); "
        f"rank{'s' if len(behind) > 1 else ''} behind: {names or 'unknown'}"
    ]
    lines += [f"  behind:  {describe(beat, now)}" for beat in behind]
    lines += [f"  rank seen: {describe(beat, now)}" for beat in beats]
    if world_size is not None and len(beats) < world_size:
        lines.append(
            f"  (heartbeats of {len(beats)} of {world_size} ranks seen: the others "
            "run on other nodes, whose reports name their own ranks)"
        )
    if all(beat.get("phase") == "step" for beat in behind):
        lines.append(
            "  every rank seen waits inside a step: the rank behind may be on "
            "another node, or hung inside the step itself"
        )
    lines.append(
        "  each rank's Python stacks (and on torch its collective trace) are "
        "printed above, under 'keras-dist: hang doctor: rank N'"
    )
    return "\n".join(lines)


def wait_for_dumps(read_beats: Callable[[], Iterable[dict]]) -> None:
    """Wait (up to `DUMP_WAIT_SECONDS`) until every rank that `read_beats`
    returns with the hang doctor on says it dumped its stacks."""
    deadline = time.monotonic() + DUMP_WAIT_SECONDS
    while time.monotonic() < deadline and not all(
        beat.get("dumped") for beat in read_beats() if beat.get("hang_timeout", 0) > 0
    ):
        time.sleep(0.05)


class HangDoctor:
    """The launcher's side: reads the heartbeats of its ranks, and when one has
    stalled, has every rank dump its stacks and returns the summary.

    Args:
        job_directory: the attempt's job directory (`KERAS_DIST_JOB_DIR`).
        heartbeat_files: each rank's heartbeat file, by rank.
        is_running: whether a rank's process still runs.
        world_size: ranks in the whole job (over all nodes).
        clock: `time.time`, replaceable in tests.

    Example:

    >>> doctor = HangDoctor(job_directory, {0: path0, 1: path1}, is_running)
    >>> report = doctor.check()  # in the watch loop; None while all is well
    """

    exit_code = HANG_EXIT_CODE

    def __init__(
        self,
        job_directory: str,
        heartbeat_files: Mapping[int, str],
        is_running: Callable[[int], bool],
        *,
        world_size: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._request = dump_request_file(job_directory)
        self._files = dict(heartbeat_files)
        self._is_running = is_running
        self._world_size = world_size
        self._clock = clock
        self._next_check = 0.0

    def _beats(self) -> dict[int, dict]:
        beats = {}
        for rank, path in self._files.items():
            beat = read_heartbeat(path) if self._is_running(rank) else None
            if beat is not None:
                beats[rank] = beat
        return beats

    def check(self) -> str | None:
        """None while every rank advances (read at most 4 times a second);
        once one has stalled: ask every rank to dump its stacks, wait for them
        (up to `DUMP_WAIT_SECONDS`) and return the summary."""
        if time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + _CHECK_INTERVAL_SECONDS
        beats = self._beats()
        if not stalled(list(beats.values()), self._clock()):
            return None
        with open(self._request, "w") as file:
            file.write(f"{self._clock()}\n")
        wait_for_dumps(lambda: self._beats().values())
        # The beats from before the dump: dumping is not progress.
        return summary(list(beats.values()), self._clock(), world_size=self._world_size)
