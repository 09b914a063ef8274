"""Scripts that trained correctly end with exit code 0 and nothing aborts in
the interpreter's teardown (see `tests/clean_exit.py`; its stress mode runs
them many times under load)."""

import pytest

from tests.clean_exit import run_once

RUNS = 2


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=pytest.mark.backend(name))
        for name in ("jax", "tensorflow", "torch")
    ],
)
def test_training_script_ends_cleanly(backend):
    for _ in range(RUNS):
        problems = run_once(backend)
        assert not problems, "\n".join(problems)
