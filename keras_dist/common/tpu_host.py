"""libtpu on a host without a TPU: quiet, and still able to describe slices.

`pip install "keras-dist[tpu]"` installs libtpu, which `kd.plan(topology=...)`
uses to compile for TPU slices on any host. JAX loads it too, when its
backends start, in every process: on a host with no TPU chip, libtpu reads
placeholder texts where a TPU VM's metadata would be and prints errors about
them (`unexpected worker hostname 'WARNING: could not determine TPU worker
hostnames ...'`, `Failed to find host bounds for accelerator type`), then JAX
goes on with its CPU (or GPU) devices.

On such a host, importing keras_dist tells libtpu what is true of any process
there: its job is this one host (`TPU_WORKER_HOSTNAMES=localhost`), a slice of
one host (`TPU_HOST_BOUNDS=1,1,1`). libtpu then starts without a word, JAX's
TPU backend finds no chip and stays out as before, and a topology described
for a plan is the one named (its size comes from the plan, not from these).

Nothing is set where a TPU may be attached (a Google TPU on the PCI bus, a
`/dev/accel*` or `/dev/vfio/<n>` device), where libtpu is not installed, or
where the user set any of libtpu's topology variables: theirs win, whole.
Standard library only: it runs at `import keras_dist`, before any backend.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import MutableMapping

#: What a host without a TPU is, in libtpu's words.
QUIET_DEFAULTS = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
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


def libtpu_installed() -> bool:
    """Whether JAX will find libtpu (the `tpu` extra, or `TPU_LIBRARY_PATH`)."""
    if os.environ.get("TPU_LIBRARY_PATH"):
        return True
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def quiet_libtpu_without_tpu(
    environ: MutableMapping[str, str] | None = None,
    *,
    root: str = "/",
    installed: bool | None = None,
) -> dict[str, str]:
    """Set `QUIET_DEFAULTS` in `environ` (the process' environment) on a host
    without a TPU where libtpu is installed and the user set none of
    `TOPOLOGY_VARIABLES`. Returns what it set (empty: nothing)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in TOPOLOGY_VARIABLES):
        return {}
    if not (libtpu_installed() if installed is None else installed):
        return {}
    if may_have_tpu(root):
        return {}
    environ.update(QUIET_DEFAULTS)
    return dict(QUIET_DEFAULTS)
