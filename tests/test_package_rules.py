"""Architecture rules that keep the package honest."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_dist"
BACKEND_IMPORT = re.compile(r"^\s*(import|from)\s+(jax|torch|tensorflow)\b", re.M)


def test_only_each_backends_own_modules_import_it():
    # jax, torch and tensorflow are imported only by the modules of the backend
    # subpackage named for them (backends/jax/, backends/torch/,
    # backends/tensorflow/), each only its own.
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {match.group(2)}"
        for path in PACKAGE.rglob("*.py")
        for match in BACKEND_IMPORT.finditer(path.read_text())
        if path.parent != PACKAGE / "backends" / match.group(2)
    ]
    assert offenders == []


def test_import_keras_dist_never_imports_an_integrations_engine():
    """Ray and Kubernetes belong to `integrations/`, installed as extras."""
    code = (
        "import sys, keras_dist, keras_dist.cluster, keras_dist.cli; "
        "print(sorted(m for m in ('ray', 'kubernetes', 'kubernetes_validate', "
        "'keras_dist_ray') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_keras_private_imports_stay_in_the_compat_modules():
    allowed = {
        "_keras_compat.py",
        "backends/jax/keras_internals.py",
        "backends/torch/keras_internals.py",
        "backends/tensorflow/keras_internals.py",
    }
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "keras.src" in path.read_text()
        and path.relative_to(PACKAGE).as_posix() not in allowed
    ]
    assert offenders == []


def test_no_pass_bodies_in_the_package():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s+pass\s*$", path.read_text(), re.M)
    ]
    assert offenders == []


def test_cli_devices_reports_this_process():
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist", "devices", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    line = result.stdout.strip().splitlines()[-1]
    assert '"num_processes": 1' in line and '"devices": ["' in line


def test_cli_launch_runs_the_script_once_per_rank(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import os\nprint('world size', os.environ['WORLD_SIZE'])\n")
    command = [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[rank 0] world size 2",
        "[rank 1] world size 2",
    ]
