"""Scripts that trained correctly end with exit code 0 and nothing aborts in
the interpreter's teardown (see `tests/clean_exit.py`; its stress mode runs
them many times under load)."""

import concurrent.futures

import pytest

from tests.clean_exit import run_once

# Runs at once: each is the other's load (an abort in the teardown shows more
# often on a busy machine), for the time of one.
RUNS = 2


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=pytest.mark.backend(name))
        for name in ("jax", "tensorflow", "torch")
    ],
)
def test_training_script_ends_cleanly(backend):
    with concurrent.futures.ThreadPoolExecutor(RUNS) as pool:
        results = list(pool.map(lambda _: run_once(backend), range(RUNS)))
    problems = [line for result in results for line in result]
    assert not problems, "\n".join(problems)
