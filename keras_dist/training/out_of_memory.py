"""A distributed call that runs out of device memory ends with a plan.

When a `fit`, `evaluate` or `predict` under keras_dist fails because a device
is out of memory (XLA's `RESOURCE_EXHAUSTED`, a CUDA out-of-memory error), the
engine's words name buffers, not the model. `OutOfDeviceMemoryError` (raised
from the engine's error, which stays its `__cause__`) adds what keras_dist
knows: each device's variables, gradients and optimizer slots under the
distribution's layouts (the static plan, from shapes only), the largest
consumers with their layouts, and which of data parallelism and FSDP (with
and without remat) would hold the model's state on the same devices, with the
`kd.plan_search` call that compiles them for the verdict that counts XLA's
temporaries too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_dist.distribution.policies import FSDP, DataParallel

_WORDS = ("resource_exhausted", "out of memory", "resource exhausted")


class OutOfDeviceMemoryError(MemoryError):
    """A distributed Keras call ran out of device memory; the message says
    what the devices hold under the distribution and what would fit."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an engine's out-of-device-memory error."""
    if isinstance(error, OutOfDeviceMemoryError):
        return False
    text = f"{type(error).__name__}: {error}".lower()
    return any(word in text for word in _WORDS)


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def _memory_of(device: Any) -> str:
    """What the message says of `device`'s memory (a plan's `DeviceTotals`)."""
    if device.memory is not None:
        return f"the device has {_gib(device.memory)}"
    why = (
        "CPU devices report none"
        if str(device.device).startswith("cpu")
        else "the device reports none, and keras_dist has no data sheet for its kind"
    )
    return f"the device's memory limit could not be read ({why})"


def explain(model: Any, distribution: Any, name: str) -> str:
    """The message of the `OutOfDeviceMemoryError` for `model`'s call `name`
    under `distribution` (shapes only: nothing is allocated)."""
    # Imported here: only a failed call needs the planner.
    from keras_dist.planner.plan import plan  # noqa: PLC0415

    # A fresh optimizer of the model's class: its slots are the same, and
    # its config is not read from variables the failed call may have left
    # without values (Keras' JAX trainer keeps them in its own state).
    compiled = getattr(model, "optimizer", None)
    optimizer = None
    if compiled is not None:
        optimizer = type(getattr(compiled, "inner_optimizer", compiled))()
    try:
        result = plan(
            model, distribution, on_indivisible="replicate", optimizer=optimizer
        )
    except Exception as error:  # the plan is a help; never hide the OOM
        return (
            f"{name} ran out of device memory under {distribution!r}; keras_dist "
            f"could not plan the model to say why ({type(error).__name__}: "
            f"{error})."
        )
    device = result.devices[0]
    lines = [
        f"{name} ran out of device memory under {distribution!r} (mesh "
        f"{result.mesh}). What each device holds before any activation or "
        f"XLA temporary (keras_dist's static plan): parameters "
        f"{_gib(device.parameters)}, gradients {_gib(device.gradients)}, "
        f"optimizer slots {_gib(device.optimizer_slots)}; {_memory_of(device)}.",
        "Largest per device:",
    ]
    for row in sorted(result.rows, key=lambda r: -r.bytes_per_device)[:5]:
        lines.append(
            f"  {row.path} {row.shape} {row.dtype} ({row.role}), layout "
            f"{row.axes}: {_gib(row.bytes_per_device)}"
        )
    lines.append("On the same devices (static, without activations):")
    devices = np.asarray(distribution.device_mesh.devices).reshape(-1).tolist()
    for label, candidate in (
        ("kd.DataParallel()", lambda: DataParallel(devices=devices)),
        ("kd.FSDP()", lambda: FSDP(devices=devices)),
        ('kd.FSDP(remat="full")', lambda: FSDP(devices=devices, remat="full")),
    ):
        try:
            other = plan(
                model, candidate(), on_indivisible="replicate", optimizer=optimizer
            )
        except Exception as error:  # a candidate that cannot be laid out
            lines.append(f"  {label}: cannot be laid out ({error})")
            continue
        first = other.devices[0]
        state = first.parameters + first.gradients + first.optimizer_slots
        verdict = (
            "no memory limit to compare with"
            if first.memory is None
            else ("would hold it" if state <= first.memory else "too large")
        )
        lines.append(f"  {label}: {_gib(state)} a device, {verdict}")
    lines.append(
        "Remat lowers the activations, not the state above. For XLA's own "
        "verdict, temporaries included, compile the candidates for these "
        "devices: keras_dist.plan_search(model_function, topology=..., "
        "batch_size=...) (JAX), or lower the batch size."
    )
    return "\n".join(lines)
