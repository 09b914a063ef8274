"""libtpu (the `tpu` extra) on a host without a TPU: quiet, and the plans
compiled for TPU slices unchanged (`keras_dist.common.tpu_host`).

The processes here need libtpu: tests/run_tpu_topology.sh runs them with
.venv-tpu (its `-k "tpu or ..."` selects every test of this module); elsewhere
they are skipped."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from keras_dist.common import tpu_host

pytestmark = pytest.mark.backend_neutral

# What libtpu prints when JAX starts it on a host without a TPU.
LIBTPU_WORDS = ("worker hostname", "host bounds", "libtpu_init_utils", "E0000")


def _device(root, name: str, vendor: str, device: str) -> None:
    folder = root / "sys/bus/pci/devices" / name
    folder.mkdir(parents=True)
    (folder / "vendor").write_text(vendor + "\n")
    (folder / "device").write_text(device + "\n")


def test_tpu_host_detection_counts_google_devices_and_tpu_device_files(tmp_path):
    assert not tpu_host.may_have_tpu(str(tmp_path))
    _device(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC
    _device(tmp_path, "0000:00:05.0", "0x8086", "0x0063")  # not Google's
    assert not tpu_host.may_have_tpu(str(tmp_path))
    _device(tmp_path, "0000:00:06.0", "0x1ae0", "0x0063")  # a v5e chip
    assert tpu_host.may_have_tpu(str(tmp_path))
    for device_file in ("dev/accel0", "dev/vfio/0"):
        root = tmp_path / device_file.replace("/", "_")
        (root / device_file).parent.mkdir(parents=True)
        (root / device_file).write_text("")
        assert tpu_host.may_have_tpu(str(root)), device_file
    # vfio's own control file is on hosts without a TPU too.
    root = tmp_path / "control"
    (root / "dev/vfio").mkdir(parents=True)
    (root / "dev/vfio/vfio").write_text("")
    assert not tpu_host.may_have_tpu(str(root))


def test_tpu_host_jax_starts_on_the_cpu_only_where_nothing_else_decides(tmp_path):
    default = tpu_host.jax_platforms_default
    host = {"root": str(tmp_path), "installed": True, "plugins": False}
    assert default({}, **host) == "cpu"
    # The user's choice wins, an empty one too (JAX's "choose for me").
    assert default({"JAX_PLATFORMS": ""}, **host) is None
    assert default({}, **dict(host, installed=False)) is None
    assert default({}, **dict(host, plugins=True)) is None
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").write_text("")
    assert default({}, **host) is None


def test_tpu_host_topology_variables_only_where_nothing_else_decides(tmp_path):
    variables = tpu_host.topology_variables
    assert variables({}, root=str(tmp_path)) == {
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_HOST_BOUNDS": "1,1,1",
    }
    # The user's variable wins, whole: nothing of ours beside it.
    for name in tpu_host.TOPOLOGY_VARIABLES:
        assert variables({name: "theirs"}, root=str(tmp_path)) == {}
    _device(tmp_path, "0000:00:06.0", "0x1ae0", "0x0063")
    assert variables({}, root=str(tmp_path)) == {}


def _environment() -> dict[str, str]:
    """This process' environment without what importing keras_dist set."""
    environ = dict(os.environ, KERAS_BACKEND="jax")
    environ.pop("KERAS_DIST_CPU_DEVICES", None)
    if environ.get("JAX_PLATFORMS") == "cpu":
        del environ["JAX_PLATFORMS"]
    return environ


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None
    or tpu_host.jax_platforms_default(_environment()) is None
    or tpu_host.topology_variables(_environment()) == {},
    reason="needs libtpu (tests/run_tpu_topology.sh), on a host with only CPUs",
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _libtpu_lines(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if any(w in line for w in LIBTPU_WORDS)
    ]


@needs_libtpu
def test_with_libtpu_a_cpu_run_and_a_tpu_plan_print_no_libtpu_errors():
    # Without keras_dist, JAX starting libtpu here prints its errors.
    plain = _run("import jax; print(jax.devices())")
    assert plain.returncode == 0, plain.stderr
    assert "worker hostname" in plain.stderr, plain.stderr
    # keras_dist first: the environment; then JAX's configuration.
    first = _run(
        "import os, keras_dist, jax; print(jax.devices(), os.environ['JAX_PLATFORMS'])"
    )
    assert first.stdout.strip() == "[CpuDevice(id=0)] cpu", first.stderr
    assert _libtpu_lines(first.stderr) == [], first.stderr
    done = _run(
        """
        import os
        import keras, numpy as np
        import keras_dist as kd
        import jax

        def build():
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
            )
            model.compile(optimizer="adam", loss="mse")
            return model

        plan = kd.plan(build, kd.DataParallel, topology="v5e:2x2", batch_size=8)
        # libtpu's variables were set for the plan only: no cluster job here.
        assert "TPU_WORKER_HOSTNAMES" not in os.environ
        model = build()
        model.fit(np.ones((8, 8)), np.ones((8, 1)), verbose=0,
                  callbacks=[kd.DistributeCallback(kd.DataParallel())])
        print("devices", jax.devices(), "peak", plan.compiled.peak_bytes)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "devices [CpuDevice(id=0)] peak " in done.stdout, done.stdout
    assert int(done.stdout.split("peak ")[1]) > 0
    assert _libtpu_lines(done.stderr) == [], done.stderr
