"""Facts about accelerator kinds, in one table that asks nobody.

What each device kind is called by the engines (`jax.Device.device_kind`:
"TPU v5 lite", "NVIDIA H100 80GB HBM3"; `torch.cuda.get_device_name`: the
same NVIDIA names), its dense peak FLOP/s per dtype (the denominator of MFU:
`Throughput`, `benchmarks/accelerator.py`) and its memory (the planner's
budget where the engine does not say it). Read by `callbacks.throughput`,
`planner` and the benchmarks; never scattered as constants.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class DeviceKind(NamedTuple):
    """One row of the table.

    Attributes:
        pattern: a regular expression matched against the engine's name for
            the device, lower-cased.
        peak_16: dense peak FLOP/s in bfloat16 or float16 on the matrix units
            (no structured sparsity), or None when not known.
        peak_32: dense peak FLOP/s in float32, or None.
        memory_bytes: the device's own memory (HBM), or None.
        memory_bandwidth: bytes per second between the device and its memory
            (HBM), or None. Read by the compiled plan's roofline.
        interconnect_bandwidth: bytes per second one chip exchanges with its
            neighbours over the chips' own links (TPU ICI, bidirectional, all
            ports), or None.
        network_bandwidth: bytes per second one chip's share of its host's
            data-center network gives it (what crosses TPU slices), or None.
        usable_bytes: what one program may allocate on the device, as the
            engine reports it (JAX's `memory_stats()["bytes_limit"]`), where
            it was read on such a device; None where only the data sheet's
            `memory_bytes` is known. The runtime keeps the rest.
        host_bandwidth: bytes per second one chip moves between its host's
            memory and its own in one direction (PCIe), or None. Read by the
            compiled plan's roofline for state offloaded to the host.
    """

    pattern: str
    peak_16: float | None
    peak_32: float | None
    memory_bytes: int | None
    memory_bandwidth: float | None = None
    interconnect_bandwidth: float | None = None
    network_bandwidth: float | None = None
    usable_bytes: int | None = None
    host_bandwidth: float | None = None


_GIB = 2**30
_GB = 10**9
# From the vendors' data sheets. TPUs multiply float32 matrices in bfloat16
# passes at JAX's default precision: the bfloat16 peak stands for both.
_KINDS: tuple[DeviceKind, ...] = (
    DeviceKind(r"\bh100\b.*\bnvl\b", None, None, 94 * _GB),  # peak not in the table
    DeviceKind(r"\bh100\b.*\bpcie\b", 756e12, 51.2e12, 80 * _GB),
    # H100 SXM and H200 (SXM; "NVIDIA H200" to torch and JAX): NVIDIA's data
    # sheets' HBM bandwidth (3.35 and 4.8 TB/s) and PCIe Gen5 x16 (128 GB/s
    # both ways, 64 GB/s one way) to the host.
    DeviceKind(r"\bh100\b", 989e12, 66.9e12, 80 * _GB, 3.35e12, host_bandwidth=64e9),
    DeviceKind(r"\bh200\b", 989e12, 66.9e12, 141 * _GB, 4.8e12, host_bandwidth=64e9),
    DeviceKind(r"\ba100\b.*\b40gb\b", 312e12, 19.5e12, 40 * _GB),
    DeviceKind(r"\ba100\b", 312e12, 19.5e12, 80 * _GB),
    DeviceKind(r"\bv100\b.*\bpcie\b", 112e12, 14e12, None),  # float16 only
    DeviceKind(r"\bv100\b", 125e12, 15.7e12, None),  # SXM2, float16 only
    DeviceKind(r"\bl40s\b", 362e12, 91.6e12, 48 * _GB),
    DeviceKind(r"\bl4\b", 121e12, 30.3e12, 24 * _GB),
    DeviceKind(r"\ba10\b", 125e12, 31.2e12, 24 * _GB),
    DeviceKind(r"\bt4\b", 65e12, 8.1e12, 16 * _GB),  # float16 only
    # TPUs: Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e):
    # peak bf16 per chip, HBM capacity and bandwidth, bidirectional ICI per
    # chip, and the data-center network per chip (v5e: 6.4 Tbps a 256-chip
    # pod; v5p: 50 Gbps a chip). None where the page gives no figure. Host
    # bandwidth (PCIe, one way, a chip): Google's "How to Scale Your Model"
    # (jax-ml.github.io/scaling-book, "How to Think About TPUs") works with
    # 1.5e10 bytes/s; Cloud's pages give none. On a v5e chip a step moving
    # 512 MiB each way took 59.2 ms, 9.1 GB/s each way at once (JAX 0.10.2,
    # benchmarks/host_transfer_check.py).
    DeviceKind(r"^tpu v4$", 275e12, 275e12, 32 * _GIB, 1200 * _GB),
    DeviceKind(
        r"^tpu v5 lite$|^tpu v5e$",
        197e12,
        197e12,
        16 * _GIB,
        819 * _GB,
        400 * _GB,
        6.4e12 / 8 / 256,
        # `bytes_limit` on a v5e chip (JAX 0.10.2, libtpu 0.0.42): 15.75 GiB.
        int(15.75 * _GIB),
        host_bandwidth=15 * _GB,
    ),
    DeviceKind(
        r"^tpu v5p?$", 459e12, 459e12, 95 * _GIB, 2765 * _GB, 1200 * _GB, 50e9 / 8
    ),
    DeviceKind(
        r"^tpu v6 lite$|^tpu v6e$",
        918e12,
        918e12,
        32 * _GIB,
        1638 * _GB,
        800 * _GB,
        host_bandwidth=15 * _GB,
    ),
)


def kind_of(name: str | None) -> DeviceKind | None:
    """The table's row for the engine's name of a device, or None (CPUs and
    kinds not in the table)."""
    lowered = (name or "").strip().lower()
    for kind in _KINDS:
        if re.search(kind.pattern, lowered):
            return kind
    return None


def memory_bytes(name: str | None) -> int | None:
    """What one program may allocate on a device of kind `name`: the engine's
    own limit where keras_dist read it on such a device, else the data
    sheet's memory; None for kinds not in the table.

    >>> memory_bytes("TPU v5 lite") / 2**30  # 16 GiB on the data sheet
    15.75
    >>> memory_bytes("TPU v4") / 2**30
    32.0
    """
    kind = kind_of(name)
    if kind is None:
        return None
    return kind.usable_bytes or kind.memory_bytes


def memory_source(name: str | None) -> str | None:
    """Where `memory_bytes(name)` comes from, in words, or None."""
    kind = kind_of(name)
    if kind is None or kind.memory_bytes is None:
        return None
    sheet = kind.memory_bytes / _GIB
    if kind.usable_bytes:
        return (
            f"{kind.usable_bytes / _GIB:.2f} GiB usable, the limit the engine "
            f"reports on such a chip ({sheet:g} GiB on the data sheet)"
        )
    return (
        f"{sheet:g} GiB, the data sheet's: the engine keeps a little of it for "
        "itself (on a TPU v5e chip 0.25 of 16 GiB), so a peak within about 2 % "
        "of it may not fit"
    )


def peak_flops_per_device(device_kind: str | None, compute_dtype: str) -> float | None:
    """The dense peak FLOP/s of one device of `device_kind`, or None when it
    is not in keras_dist's table (CPUs have no meaningful peak).

    Args:
        device_kind: the engine's name for the device, e.g. "NVIDIA H100 80GB
            HBM3" or "TPU v4" (`jax.Device.device_kind`,
            `torch.cuda.get_device_name`).
        compute_dtype: the dtype the model computes in; 16-bit dtypes get the
            matrix units' 16-bit peak, anything else the float32 one.

    Example:

    >>> peak_flops_per_device("NVIDIA A100-SXM4-80GB", "bfloat16")
    312000000000000.0
    >>> peak_flops_per_device("cpu", "float32") is None
    True
    """
    kind = kind_of(device_kind)
    if kind is None:
        return None
    return kind.peak_16 if compute_dtype in ("bfloat16", "float16") else kind.peak_32
