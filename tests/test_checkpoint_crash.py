"""Crash consistency of `kd.Checkpoint` (issue 12): SIGKILL during saves never
leaves a checkpoint that `kd.restore` accepts but that is incomplete.

A real process (`tests/workers/checkpoint_crash_worker.py`: a 3 MiB kernel,
a background save after every step, `max_to_keep=3`) is killed outright 3
times in the same directory, each time at a random moment once it trains (its
first save committed); each new run resumes from what the last one left.
After every kill:

- every step directory that counts as complete (`store.complete_steps`) has
  every file its manifest lists, with the listed size, and nothing else;
- `kd.restore` of each of them gives the weights the process had at that step
  (bit for bit: the SHA-256 it wrote before the save) and its iteration count;
- a `.tmp-step-*` directory is never picked, and one a kill left behind is
  gone once the next run committed a step (pruned);
- the next run resumes from the newest complete step.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.checkpoint import store
from tests.conftest import BACKEND
from tests.fork_server import start_python
from tests.multiprocess import WORKERS
from tests.workers.checkpoint_crash_worker import (
    FEATURES,
    build,
    fingerprint,
    iterations,
)

KILLS = 2


def _start(directory, state):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env["KERAS_BACKEND"] = BACKEND
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(WORKERS.parent.parent), env.get("PYTHONPATH", "")]
    )
    if BACKEND != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    # Forked from a process that has imported Keras (tests/fork_server.py),
    # in a session of its own.
    return start_python(
        [WORKERS / "checkpoint_crash_worker.py", directory, state],
        env=env,
        output=state / "log.txt",
        append=True,
    )


def _wait_until_training(process, state, timeout: float = 120.0) -> dict:
    path = state / f"started-{process.pid}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(
                f"the worker ended before training (exit {process.returncode}):\n"
                + (state / "log.txt").read_text()[-4000:]
            )
        assert time.monotonic() < deadline, "the worker never trained"
        time.sleep(0.02)
    return json.loads(path.read_text())


def _fingerprints(state) -> dict[int, set[str]]:
    """Step -> the weights' hashes the runs had there (a rerun of a step
    after a resume may differ in the last bits)."""
    found: dict[int, set[str]] = {}
    for line in (state / "fingerprints.jsonl").read_text().splitlines():
        if line.endswith("}"):  # the last line may be cut by the kill
            entry = json.loads(line)
            found.setdefault(entry["step"], set()).add(entry["sha256"])
    return found


def _assert_consistent(directory, state, context: str) -> tuple[int | None, set]:
    """The invariants after a kill: returns the newest complete step and the
    temporary directories the kill left (the next run must remove them)."""
    names = sorted(os.listdir(directory)) if directory.exists() else []
    complete = store.complete_steps(str(directory))
    for name in names:
        assert re.fullmatch(r"(\.tmp-)?step-\d{9}", name), f"{context}: {names}"
    newest = complete[-1] if complete else None
    # What the kill cut short: a save (`.tmp-step-<N>`) or a removal by
    # `prune` (renamed to `.tmp-step-<N>` first, or a torn `step-<N>`).
    # Every directory that is not a complete step (an unfinished save, a
    # removal cut short) must go once a later run commits past it.
    left = {name for name in names if int(name.rsplit("-", 1)[1]) not in complete}
    fingerprints = _fingerprints(state)
    for step in complete:
        path = directory / f"step-{step:09d}"
        manifest = json.loads((path / store.MANIFEST).read_text())
        assert manifest["step"] == step, context
        on_disk = {
            os.path.relpath(os.path.join(root, name), path)
            for root, _, files in os.walk(path)
            for name in files
        } - {store.MANIFEST}
        assert on_disk == set(manifest["files"]), f"{context}: step {step}"
        for name, size in manifest["files"].items():
            assert (path / name).stat().st_size == size, f"{context}: {name}"
        model = build()
        assert kd.restore(model, directory, step=step) == step
        assert iterations(model) == step, f"{context}: step {step}"
        assert fingerprint(model) in fingerprints.get(step, set()), (
            f"{context}: the weights restored from step {step} are none the "
            "process had at that step"
        )
    if complete:
        assert kd.restore(build(), directory) == newest
    return newest, left


def test_sigkill_during_background_saves_never_leaves_a_torn_checkpoint(tmp_path):
    seed = random.randrange(1 << 30)
    delays = random.Random(seed).sample([0.1 * i for i in range(2, 21)], KILLS)
    directory, state = tmp_path / "ck", tmp_path / "state"
    state.mkdir()
    newest = None
    committed = []
    left_before: set = set()
    for run, delay in enumerate(delays):
        context = f"run {run} (seed {seed}, killed {delay:.1f} s into training)"
        process = _start(directory, state)
        try:
            started = _wait_until_training(process, state)
            # It resumed from the newest complete step the last kill left.
            assert started["resumed_from"] == (newest or 0), context
            time.sleep(delay)
            assert process.poll() is None, (state / "log.txt").read_text()[-4000:]
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        newest, left = _assert_consistent(directory, state, context)
        # What the previous kill left is gone once this run committed past
        # it: saved again, or pruned.
        stale = [
            name
            for name in left_before & set(os.listdir(directory))
            if int(name.rsplit("-", 1)[1]) <= (newest or 0)
        ]
        assert not stale, f"{context}: {stale} stayed"
        left_before = left
        committed.append(newest)
        print(f"{context}: newest complete step {newest}; {os.listdir(directory)}")
    # Each run committed at least its first save before the kill: something
    # was checked every time, and every run went further.
    assert all(step is not None for step in committed), committed
    assert committed == sorted(set(committed)), committed


@pytest.mark.parametrize("what", ["manifest", "file"])
def test_a_step_directory_with_a_torn_file_or_manifest_is_not_restored(tmp_path, what):
    """What the kills above may not hit: a committed directory damaged later."""
    model = build()
    directory = tmp_path / "ck"
    x = np.random.default_rng(2).normal(size=(16, FEATURES)).astype("float32")
    model.fit(
        x,
        x[:, :1],
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[kd.Checkpoint(directory, save_freq=1, save_on_background=False)],
    )
    assert store.complete_steps(str(directory)) == [1, 2]
    path = directory / "step-000000002"
    manifest = json.loads((path / store.MANIFEST).read_text())
    if what == "manifest":
        text = (path / store.MANIFEST).read_text()
        (path / store.MANIFEST).write_text(text[: len(text) // 2])
    else:
        largest = max(manifest["files"], key=manifest["files"].get)
        with open(path / largest, "r+b") as handle:
            handle.truncate(manifest["files"][largest] - 1)
    assert store.complete_steps(str(directory)) == [1]
    # Never skipped without a word: the warning names the step and the file.
    named = store.MANIFEST if what == "manifest" else largest
    with pytest.warns(RuntimeWarning, match="restoring step 1 instead") as warned:
        assert kd.restore(build(), directory) == 1
    assert str(path) in str(warned[0].message)
    assert named in str(warned[0].message)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        kd.restore(build(), directory, step=2)
    with pytest.raises(kd.checkpoint.DamagedCheckpointError, match="step 2"):
        kd.restore(build(), directory, on_damaged="raise")
