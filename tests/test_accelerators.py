"""The table of accelerator kinds (`keras_dist.common.accelerators`): what the
engines call each device, its peak FLOP/s and its memory, read by
`Throughput`, the planner and `benchmarks/accelerator.py`."""

from __future__ import annotations

import pytest

from keras_dist.common.accelerators import (
    kind_of,
    memory_bytes,
    memory_source,
    peak_flops_per_device,
)

pytestmark = pytest.mark.backend_neutral


@pytest.mark.parametrize(
    ("name", "peak_16", "peak_32", "memory"),
    [
        # What JAX 0.10 calls the TPU v5e chip the device tool lends: 16 GiB
        # on the data sheet, 15.75 GiB what JAX lets a program allocate there.
        ("TPU v5 lite", 197e12, 197e12, int(15.75 * 2**30)),
        ("TPU v4", 275e12, 275e12, 32 * 2**30),
        ("NVIDIA H100 80GB HBM3", 989e12, 66.9e12, 80 * 10**9),
        ("NVIDIA H100 PCIe", 756e12, 51.2e12, 80 * 10**9),
        # What torch and JAX call the H200 (SXM, 141 GB).
        ("NVIDIA H200", 989e12, 66.9e12, 141 * 10**9),
        ("NVIDIA A100-SXM4-40GB", 312e12, 19.5e12, 40 * 10**9),
        ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 80 * 10**9),
    ],
)
def test_known_kinds(name, peak_16, peak_32, memory):
    assert peak_flops_per_device(name, "bfloat16") == peak_16
    assert peak_flops_per_device(name, "float16") == peak_16
    assert peak_flops_per_device(name, "float32") == peak_32
    assert memory_bytes(name) == memory
    assert kind_of(name) is not None


def test_the_memory_source_says_whether_it_is_the_usable_limit():
    assert memory_source("TPU v5 lite").startswith("15.75 GiB usable")
    assert "16 GiB on the data sheet" in memory_source("TPU v5 lite")
    assert memory_source("TPU v4").startswith("32 GiB, the data sheet's")
    assert memory_source("cpu") is None


@pytest.mark.parametrize("name", ["cpu", "", None, "Some future accelerator"])
def test_unknown_kinds_have_no_figures(name):
    assert kind_of(name) is None
    assert memory_bytes(name) is None
    assert peak_flops_per_device(name, "bfloat16") is None
