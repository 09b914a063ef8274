"""`kd.Checkpoint` refuses, when `fit` starts, a job whose processes were given
different directories (each rank's own TMPDIR under `keras-dist launch`),
naming the ranks, their directories and the fix; paths that resolve to one
directory (a link) are one. Real processes on loopback: torch's gloo, JAX's
coordination service, TensorFlow's multi-worker all-reduce."""

from __future__ import annotations

import os

import pytest

from keras_dist.checkpoint import same_directory
from tests.conftest import BACKEND
from tests.multiprocess import run_job


def _environment() -> dict[str, str]:
    env = {"KERAS_BACKEND": BACKEND}
    if BACKEND != "torch":
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    return env


@pytest.mark.backend("jax", "torch", "tensorflow")
def test_processes_given_different_directories_are_refused_at_once(tmp_path):
    base = tmp_path / "base"
    (base / "shared").mkdir(parents=True)
    os.symlink(base / "shared", base / "link")
    results = run_job(
        "checkpoint_directory_worker.py",
        [str(base)],
        processes=2,
        env=_environment(),
        output_dir=tmp_path / "out",
        timeout=240,
    )
    for rank, result in enumerate(results):
        refusal = result["refusal"]
        assert refusal is not None and refusal["type"] == "ValueError", result
        assert result["untouched"], result
        message = refusal["message"]
        assert "the 2 processes of this job were given 2 different" in message
        assert f"rank 0: {str(base / 'own-0')!r}" in message
        assert f"rank 1: {str(base / 'own-1')!r}" in message
        assert "pass one path that every process sees" in message
        assert "TMPDIR" in message
        # Refused before anything was created, not after a save's timeout.
        assert not result["own_made"], rank
        assert result["seconds"] < 60, result
        # A link to the directory rank 0 was given is the same directory.
        assert result["steps"] == ["step-000000002"], result


@pytest.mark.backend_neutral
def test_the_message_groups_ranks_that_share_a_directory():
    paths = ["/a", "/a", "/b", "/a", "/a", "/a", "/a", "/c"]
    message = same_directory._message("kd.Checkpoint", paths)
    assert message.startswith(
        "kd.Checkpoint: the 8 processes of this job were given 3 different "
        "checkpoint directories (ranks 0, 1, 3, 4, 5 and 1 more: '/a'; "
        "rank 2: '/b'; rank 7: '/c')."
    )
    many = same_directory._message("kd.Checkpoint", [f"/{r}" for r in range(12)])
    assert "rank 7: '/7'; and 4 more directories)" in many
