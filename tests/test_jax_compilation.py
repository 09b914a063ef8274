"""Each JAX step function compiles once per input signature (issue 39).

Every compilation XLA makes over `fit` (3 epochs, validation data), `fit`
again, `evaluate`, `predict`, `fit` and `predict` again is counted through
`jax.monitoring` in a fresh process (`workers/compile_count_worker.py`; the
scenarios on 8 devices one after the other in one, each from emptied caches),
for plain Keras and for keras_dist, and compared: keras_dist compiles each of
`train_step`, `test_step` and `predict_step` once per input signature (no
recompilation at an epoch's start, between calls or after `evaluate`), and no
more programs than plain Keras. Before the fix a one-device mesh (one chip)
compiled `train_step` three times and `test_step` twice: Keras kept arrays of
the state on their device as they were while the steps' outputs came back on
the mesh.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fork_server import start_python
from tests.multiprocess import once_per_run

pytestmark = pytest.mark.backend("jax")

WORKER = Path(__file__).parent / "workers" / "compile_count_worker.py"
STEPS = ("jit(train_step)", "jit(test_step)", "jit(predict_step)")


def _run(scenarios: list[str], devices: int, tmp_path: Path) -> dict[str, dict]:
    """Both candidates' counts per scenario: the candidates side by side in
    fresh processes, the scenarios one after the other in each (each counted
    as in a process of its own: see the worker)."""
    env = dict(os.environ, KERAS_BACKEND="jax", KERAS_DIST_CPU_DEVICES=str(devices))
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(WORKER.parent), env.get("PYTHONPATH")])
    )
    running = {}
    for candidate in ("plain", "keras_dist"):
        output = tmp_path / f"{candidate}.json"
        # Forked from a process that has imported Keras and JAX and compiled
        # nothing (tests/fork_server.py: each start-up costs seconds).
        process = start_python(
            [WORKER, ",".join(scenarios), candidate, output],
            env=env,
            output=tmp_path / f"{candidate}.log",
        )
        running[candidate] = (process, output)
    results: dict[str, dict] = {scenario: {} for scenario in scenarios}
    for candidate, (process, output) in running.items():
        try:
            process.wait(timeout=300)
        finally:
            process.kill()
        log = (tmp_path / f"{candidate}.log").read_text()
        assert process.returncode == 0, log[-3000:]
        for scenario, counted in json.loads(output.read_text()).items():
            assert counted["devices"] == devices
            results[scenario][candidate] = counted
    return results


# The scenarios on 8 devices in one pair of processes (each start-up costs
# seconds: CI's time).
EIGHT_DEVICES = ["uneven_batch_norm", "steps_per_execution", "fsdp"]


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> dict[str, dict]:
    return once_per_run(
        tmp_path_factory,
        "jax_compile_counts",
        lambda directory: _run(EIGHT_DEVICES, 8, directory),
    )


def _counts(scenario: str, devices: int, tmp_path: Path) -> dict[str, dict]:
    return _run([scenario], devices, tmp_path)[scenario]


def _steps(counts: dict[str, int]) -> dict[str, int]:
    return {name: counts.get(name, 0) for name in STEPS}


def test_one_device_mesh_compiles_each_step_once(tmp_path):
    """A mesh of one device, as on one accelerator chip."""
    results = _counts("one_device", 1, tmp_path)
    ours, plain = results["keras_dist"]["compiles"], results["plain"]["compiles"]
    assert _steps(ours) == dict.fromkeys(STEPS, 1), ours
    assert _steps(plain) == dict.fromkeys(STEPS, 1), plain
    assert sum(ours.values()) <= sum(plain.values()), (ours, plain)


def test_uneven_batches_compile_once_per_batch_shape(eight_devices):
    """8 devices, 100 rows in batches of 32: the last batch (4 rows, padded to
    8) is a second input signature, as the short batch is for plain Keras;
    BatchNormalization's global statistics add no program."""
    results = eight_devices["uneven_batch_norm"]
    ours, plain = results["keras_dist"]["compiles"], results["plain"]["compiles"]
    assert _steps(ours) == dict.fromkeys(STEPS, 2), ours
    assert _steps(ours) == _steps(plain)
    # Trimming the padded predictions adds no program (done on the host).
    assert sum(ours.values()) <= sum(plain.values()), (ours, plain)
    assert results["keras_dist"]["rows_predicted"] == 100


def test_steps_per_execution_compiles_each_step_once(eight_devices):
    results = eight_devices["steps_per_execution"]
    ours, plain = results["keras_dist"]["compiles"], results["plain"]["compiles"]
    assert _steps(ours) == dict.fromkeys(STEPS, 1), ours
    assert sum(ours.values()) <= sum(plain.values()), (ours, plain)


def test_split_variables_compile_each_step_once(eight_devices):
    """`kd.FSDP` on 8 devices, the model built before: besides plain Keras'
    programs only the slicing that splits the existing variables once, when
    the run starts (one program per variable shape)."""
    results = eight_devices["fsdp"]
    ours, plain = results["keras_dist"]["compiles"], results["plain"]["compiles"]
    assert _steps(ours) == dict.fromkeys(STEPS, 1), ours
    extra = {
        name: count - plain.get(name, 0)
        for name, count in ours.items()
        if count > plain.get(name, 0)
    }
    assert set(extra) <= {"jit(_multi_slice)"}, extra
    # At most one per shape of the split variables (kernels 16x32 and 32x8,
    # biases 32 and 8; Adam's slots share them), not one per call or epoch.
    assert extra.get("jit(_multi_slice)", 0) <= 4, extra
