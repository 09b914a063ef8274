"""Test set-up: the Keras backend is fixed per process (`KERAS_BACKEND`).

Run the suite once per backend (`tests/run_all_backends.sh` does). Tests marked
`@pytest.mark.backend("jax")` run only under that backend. JAX and TensorFlow
runs simulate CPU devices (`KERAS_DIST_CPU_DEVICES`: 8 on JAX, 4 on TensorFlow).
"""

from __future__ import annotations

import os
import pathlib
import sys

import keras
import pytest

# Worker modules imported in-process (`tests.workers.x`) share helpers with the
# worker scripts, which import them by plain name (`import worker_seed`).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "workers"))

BACKEND = keras.backend.backend()


# Tests marked `backend_neutral` do the same under every backend (the
# launcher, the package's import rules, ...): they run once, under this one.
NEUTRAL_BACKEND = os.environ.get("KERAS_DIST_NEUTRAL_TESTS_BACKEND", "jax")


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(autouse=True)
def _no_distribution_leaks():
    """Every test starts and ends with no global distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)
