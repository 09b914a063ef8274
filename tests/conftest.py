"""Test set-up: the Keras backend is fixed per process (`KERAS_BACKEND`).

Run the suite once per backend (`tests/run_all_backends.sh` does). Tests marked
`@pytest.mark.backend("jax")` run only under that backend. JAX and TensorFlow
runs simulate CPU devices (`KERAS_DIST_CPU_DEVICES`: 8 on JAX, 4 on TensorFlow).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# Worker modules imported in-process (`tests.workers.x`) share helpers with the
# worker scripts, which import them by plain name (`import worker_seed`).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "workers"))


def _backend() -> str:
    """The backend Keras will use: KERAS_BACKEND when set (xdist's controller
    process, which runs no test, then never imports Keras: seconds of CPU
    per run that the workers need), else Keras' own answer."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    import keras  # noqa: PLC0415

    return keras.backend.backend()


BACKEND = _backend()


# Tests marked `backend_neutral` do the same under every backend (the
# launcher, the package's import rules, ...): they run once, under this one.
NEUTRAL_BACKEND = os.environ.get("KERAS_DIST_NEUTRAL_TESTS_BACKEND", "jax")


# Modules whose tests start real processes (or a Ray cluster) run first, the
# longest first, so that xdist's workers end together instead of one waiting
# for the other's last long job (CI's time). The order within a module stays.
RUN_FIRST = (
    "integrations/test_ray.py",
    "test_multiprocess_torch.py",
    "test_elastic.py",
    "test_checkpoint_jobs.py",
    "test_multiprocess_tf.py",
    "test_multiprocess_jax.py",
    "test_context_parallel.py",
    "test_tpu_pod.py",
    "test_layouts.py",
    "test_fine_tune_recipe.py",
    "test_example_resume.py",
    "test_documented_commands.py",
    "test_keras_versions.py",
    "test_one_writer.py",
    "test_fault_lifecycle.py",
    "test_examples_torch.py",
    "test_checkpoint_jax.py",
    "test_checkpoint_same_directory.py",
    "test_failure_recovery.py",
    "test_docs_code_blocks.py",
    "test_shuffle_order.py",
    "test_checkpoint_tensorflow.py",
    "test_multiprocess_torch_fsdp",
)


def _run_first_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    for rank, name in enumerate(RUN_FIRST):
        if path.startswith(f"tests/{name}"):
            return rank
    return len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_first_rank)
    for item in items:
        marker = item.get_closest_marker("backend")
        if marker is not None and BACKEND not in marker.args:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs backend {marker.args}, running {BACKEND}"
                )
            )
        elif (
            marker is None
            and item.get_closest_marker("backend_neutral") is not None
            and BACKEND != NEUTRAL_BACKEND
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"backend-neutral: runs once, under {NEUTRAL_BACKEND} "
                    "(KERAS_DIST_NEUTRAL_TESTS_BACKEND)"
                )
            )


TIMELINE = os.environ.get("KERAS_DIST_TEST_TIMELINE")


if TIMELINE:
    import json
    import time

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """KERAS_DIST_TEST_TIMELINE=FILE: one JSON line per test (worker, start,
        end) appended to FILE, to see how CI's time is spent."""
        start = time.time()
        try:
            return (yield)
        finally:
            with open(TIMELINE, "a") as timeline:
                line = {
                    "test": item.nodeid,
                    "backend": BACKEND,
                    "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                    "start": start,
                    "end": time.time(),
                }
                timeline.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _no_distribution_leaks():
    """Every test starts and ends with no global distribution."""
    import keras  # noqa: PLC0415

    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)
