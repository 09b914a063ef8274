"""The suite's fork server (`tests/fork_server.py`), used from several threads
at once, as a test that runs two jobs side by side uses it: each thread gets
its own child's pid, output and exit code, however the server's answers and
the children's ends interleave."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess

import pytest

from tests.fork_server import start_python

pytestmark = pytest.mark.backend_neutral

SCRIPT = """
import os, sys, time
time.sleep(float(sys.argv[2]))
print("child", sys.argv[1], os.environ["WHO"])
sys.exit(int(sys.argv[1]))
"""


def test_threads_starting_and_waiting_at_once_each_get_their_own_child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)

    def run(index: int) -> tuple[int, int, str]:
        # Short and long children, so that one thread waits for an end while
        # others start theirs (the server's answers interleave).
        output = tmp_path / f"out-{index}.txt"
        child = start_python(
            [script, str(index), "0.2" if index % 2 else "0"],
            env={**os.environ, "WHO": f"thread-{index}"},
            output=output,
            cwd=tmp_path,
        )
        code = child.wait(timeout=120)
        return child.pid, code, output.read_text()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(12)))
    pids = [pid for pid, _, _ in results]
    assert len(set(pids)) == len(pids)
    for index, (_, code, output) in enumerate(results):
        assert code == index
        assert output == f"child {index} thread-{index}\n"


def test_a_child_still_running_is_a_timeout_then_its_code(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    child = start_python(
        [script, "3", "1"],
        env={**os.environ, "WHO": "one"},
        output=tmp_path / "out",
        cwd=tmp_path,
    )
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.wait(timeout=120) == 3
