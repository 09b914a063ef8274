"""libtpu on a host without a TPU: quiet, and still able to describe slices.

`pip install "keras-dist[tpu]"` installs libtpu, which `kd.plan(topology=...)`
uses to compile for TPU slices on any host. JAX loads it too, when its
backends start, in every process: on a host with no TPU chip, libtpu reads
placeholder texts where a TPU VM's metadata would be and prints errors about
them (`unexpected worker hostname 'WARNING: could not determine TPU worker
hostnames ...'`, `Failed to find host bounds for accelerator type`), then JAX
goes on with its CPU devices.

Two things keep it quiet, each only where nothing else decides:

- `jax_platforms_default`: on a host where JAX could only find CPU devices
  (no TPU may be attached, no GPU device file, no other JAX plugin), JAX
  starts its CPU backend alone (`JAX_PLATFORMS=cpu`), as it would end up
  doing after libtpu's errors. Not where the user set `JAX_PLATFORMS`.
- `topology_variables`: while libtpu describes a TPU slice for a plan on such
  a host, it is told what is true of the process, a job of this one host
  (`TPU_WORKER_HOSTNAMES=localhost`, `TPU_HOST_BOUNDS=1,1,1`); the slice
  described is the one the plan names. Not where the user set any of libtpu's
  topology variables (theirs win, whole). They are set only for that call:
  the same names describe a Cloud TPU job to keras_dist's and JAX's cluster
  detection.

"A TPU may be attached": a Google TPU on the PCI bus, a `/dev/accel*` or a
`/dev/vfio/<n>` device. Standard library only: it runs at `import keras_dist`,
before any backend.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping

#: What a host without a TPU is, in libtpu's words (a plan's description only).
QUIET_TOPOLOGY = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
#: libtpu's (and JAX's `cloud_tpu_init`'s) topology variables: one set by the
#: user means the user describes the host, and keras_dist sets none.
TOPOLOGY_VARIABLES = (
    "TPU_ACCELERATOR_TYPE",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_HOST_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
)
_GOOGLE_PCI_VENDOR = "0x1ae0"
# Google's PCI devices that are not TPUs (Compute Engine's gVNIC network card
# and NVMe disks). Any other Google device counts as a TPU: a generation not
# known here, or a device misread, leaves libtpu as it is (the safe side).
_GOOGLE_NON_TPU_DEVICES = {"0x0042", "0x001f"}
# The device files JAX looks for before it starts a GPU backend.
_GPU_DEVICE_FILES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "dev/kfd")


def may_have_tpu(root: str = "/") -> bool:
    """Whether a TPU may be attached to this host (under `root`, for tests)."""
    for vendor_path in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            with open(vendor_path) as vendor:
                if vendor.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as device:
                if device.read().strip() not in _GOOGLE_NON_TPU_DEVICES:
                    return True
        except OSError:
            return True  # unreadable: assume the worst, set nothing
    accel = glob.glob(os.path.join(root, "dev/accel*"))
    vfio = glob.glob(os.path.join(root, "dev/vfio/[0-9]*"))
    return bool(accel or vfio)


def may_have_gpu(root: str = "/") -> bool:
    """Whether JAX may find a GPU here (its own device-file checks)."""
    return any(os.path.exists(os.path.join(root, name)) for name in _GPU_DEVICE_FILES)


def libtpu_installed() -> bool:
    """Whether JAX will find libtpu (the `tpu` extra, or `TPU_LIBRARY_PATH`)."""
    if os.environ.get("TPU_LIBRARY_PATH"):
        return True
    return importlib.util.find_spec("libtpu") is not None


def other_jax_plugins() -> bool:
    """Whether a JAX plugin besides libtpu is installed (CUDA's, ROCm's...)."""
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return importlib.util.find_spec("jax_plugins") is not None


def jax_platforms_default(
    environ: Mapping[str, str] | None = None,
    *,
    root: str = "/",
    installed: bool | None = None,
    plugins: bool | None = None,
) -> str | None:
    """`"cpu"` where JAX would start libtpu only to find no TPU: libtpu
    installed, no TPU may be attached, no GPU and no other JAX plugin, and
    `JAX_PLATFORMS` not set by the user; else None (leave JAX alone)."""
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in environ:
        return None
    if not (libtpu_installed() if installed is None else installed):
        return None
    if may_have_tpu(root) or may_have_gpu(root):
        return None
    if other_jax_plugins() if plugins is None else plugins:
        return None
    return "cpu"


def topology_variables(
    environ: Mapping[str, str] | None = None, *, root: str = "/"
) -> dict[str, str]:
    """What to set while libtpu describes a TPU slice for a plan in this
    process: `QUIET_TOPOLOGY` on a host without a TPU where the user set
    none of `TOPOLOGY_VARIABLES`, else nothing."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in TOPOLOGY_VARIABLES) or may_have_tpu(root):
        return {}
    return dict(QUIET_TOPOLOGY)
