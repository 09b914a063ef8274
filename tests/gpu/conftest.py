"""The GPU suite (`tests/run_gpu.sh` runs it on a machine with an NVIDIA GPU).

Every test here skips, at once, where the backend sees no CUDA device: CI
collects this folder on each backend and pays nothing but the collection.
`KERAS_DIST_GPU_TESTS_ON_CPU=1` runs them on the CPU devices instead (JAX's
simulated ones, torch's CPU), which checks the tests' own logic without a
GPU; the checks that only a GPU can make (its memory kinds, cuDNN's
attention, a real memory limit) then skip, each saying so.
"""

from __future__ import annotations

import functools
import os

import pytest

ON_CPU_VARIABLE = "KERAS_DIST_GPU_TESTS_ON_CPU"


def on_cpu() -> bool:
    """Whether the suite runs on CPU devices (`KERAS_DIST_GPU_TESTS_ON_CPU=1`)."""
    return os.environ.get(ON_CPU_VARIABLE) == "1"


@functools.cache
def cuda_present() -> bool:
    """Whether this process' backend sees a CUDA device. Asked only of a test
    that runs (the backend marker has already skipped the others)."""
    backend = os.environ.get("KERAS_BACKEND", "")
    if backend == "torch":
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    if backend == "jax":
        import jax  # noqa: PLC0415

        return any(device.platform == "gpu" for device in jax.devices())
    return False


def needs_cuda(what: str) -> None:
    """Skip the calling test where it runs on CPU devices: `what` needs a GPU."""
    if not cuda_present():
        pytest.skip(f"{what} needs a CUDA GPU (running on CPU devices)")


# Module-scoped: set up before a module's own module-scoped fixtures (the
# torch module's jobs), so that nothing runs where the tests skip.
@pytest.fixture(autouse=True, scope="module")
def _only_with_a_gpu():
    if not on_cpu() and not cuda_present():
        pytest.skip(
            "no CUDA GPU: tests/run_gpu.sh runs these on one "
            f"({ON_CPU_VARIABLE}=1 runs them on CPU devices)"
        )
