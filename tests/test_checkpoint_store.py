"""Step directories (`keras_dist.checkpoint.store`): what a kill at any moment
leaves is never picked, and the next prune removes it."""

from __future__ import annotations

import os

from keras_dist.checkpoint import store


def _commit(directory, step: int) -> None:
    temporary = store.prepare(str(directory), step)
    with open(os.path.join(temporary, "data"), "wb") as handle:
        handle.write(b"x" * (10 + step))
    store.commit(str(directory), step, {"engine": "test", "entries": {}})


def test_prune_keeps_the_newest_and_sweeps_what_kills_left(tmp_path):
    for step in (2, 4, 6, 8):
        _commit(tmp_path, step)
    # A removal cut short (its manifest went first), an unfinished save of an
    # old step, a commit cut between its renames.
    os.remove(os.path.join(store.step_directory(str(tmp_path), 2), store.MANIFEST))
    os.makedirs(store.temporary_directory(str(tmp_path), 3))
    os.makedirs(store.step_directory(str(tmp_path), 4) + ".replaced")
    # An unfinished save of a newer step: still being written, it stays.
    os.makedirs(store.temporary_directory(str(tmp_path), 10))

    assert store.complete_steps(str(tmp_path)) == [4, 6, 8]
    assert store.prune(str(tmp_path), 2) == [4]
    assert sorted(os.listdir(tmp_path)) == [
        ".tmp-step-000000010",
        "step-000000006",
        "step-000000008",
    ]


def test_the_same_step_committed_again_replaces_it_whole(tmp_path):
    _commit(tmp_path, 4)
    _commit(tmp_path, 4)
    assert os.listdir(tmp_path) == ["step-000000004"]
    assert store.latest_step(str(tmp_path)) == 4
