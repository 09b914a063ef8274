"""The dense peak FLOP/s of common accelerators: the denominator of MFU."""

from __future__ import annotations

import re

# Dense peak FLOP/s per device (no structured sparsity), from the vendors'
# data sheets: (16-bit: bfloat16 or float16 on the matrix units, float32).
# TPUs multiply float32 matrices in bfloat16 passes by default: the bfloat16
# peak stands for both.
_PEAKS: tuple[tuple[str, float | None, float | None], ...] = (
    (r"\bh100\b.*\bnvl\b", None, None),  # not in the table
    (r"\bh100\b.*\bpcie\b", 756e12, 51.2e12),
    (r"\bh100\b", 989e12, 66.9e12),  # SXM
    (r"\bh200\b", 989e12, 66.9e12),
    (r"\ba100\b", 312e12, 19.5e12),
    (r"\bv100\b.*\bpcie\b", 112e12, 14e12),  # float16 only
    (r"\bv100\b", 125e12, 15.7e12),  # SXM2, float16 only
    (r"\bl40s\b", 362e12, 91.6e12),
    (r"\bl4\b", 121e12, 30.3e12),
    (r"\ba10\b", 125e12, 31.2e12),
    (r"\bt4\b", 65e12, 8.1e12),  # float16 only
    (r"^tpu v4$", 275e12, 275e12),
    (r"^tpu v5 lite$|^tpu v5e$", 197e12, 197e12),
    (r"^tpu v5p?$", 459e12, 459e12),
    (r"^tpu v6 lite$|^tpu v6e$", 918e12, 918e12),
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
    name = (device_kind or "").strip().lower()
    sixteen_bit = compute_dtype in ("bfloat16", "float16")
    for pattern, peak_16, peak_32 in _PEAKS:
        if re.search(pattern, name):
            return peak_16 if sixteen_bit else peak_32
    return None
