"""A distributed call that runs out of device memory ends with a plan.

When a `fit`, `evaluate` or `predict` under keras_dist fails because a device
is out of memory (XLA's `RESOURCE_EXHAUSTED`, a CUDA out-of-memory error), the
engine's words name buffers, not the model. `OutOfDeviceMemoryError` (raised
from the engine's error, which stays its `__cause__`) adds what keras_dist
knows. On JAX, where the failing call's batch was seen, the step is compiled
again for the devices in use (`keras_dist.planner.on_devices`): the real
shortfall, XLA's parts of the peak, the largest variables and slots, and the
variants that would fit on these devices, each compiled (a bounded number of
compiles and seconds). Elsewhere (PyTorch, TensorFlow) it is the static plan,
from shapes only: each device's variables, gradients and optimizer slots
under the distribution's layouts, the largest consumers with their layouts,
and which of data parallelism and FSDP would hold that state.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from keras_dist.distribution.policies import FSDP, DataParallel

# XLA's `RESOURCE_EXHAUSTED`, CUDA's "out of memory", and torch's
# `torch.OutOfMemoryError` (`torch.cuda.OutOfMemoryError`) by its type's name.
_WORDS = (
    "resource_exhausted",
    "out of memory",
    "resource exhausted",
    "outofmemoryerror",
)


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


def explain(model: Any, distribution: Any, name: str, error: str = "") -> str:
    """The message of the `OutOfDeviceMemoryError` for `model`'s call `name`
    under `distribution` that failed with the engine's words `error`: the
    step compiled for the devices in use where the backend can (JAX), else
    the static plan (shapes only: nothing is allocated)."""
    # Imported here: only a failed call needs the planner.
    from keras_dist.planner import on_devices  # noqa: PLC0415

    try:
        compiled = on_devices.explain(model, distribution, name, error)
    except Exception as problem:  # the plan is a help; never hide the OOM
        compiled = None
        reason = (
            f"compiling the step again failed ({type(problem).__name__}: {problem})"
        )
    else:
        reason = "this backend compiles no plan, or the call's batch was not seen"
    if compiled is not None:
        return compiled
    return static_explanation(model, distribution, name) + (
        f"\n(From shapes only: {reason}.)"
    )


def static_explanation(model: Any, distribution: Any, name: str) -> str:
    """The static plan's account of the failed call (shapes only)."""
    from keras_dist.planner.on_devices import fresh_optimizer  # noqa: PLC0415
    from keras_dist.planner.plan import plan  # noqa: PLC0415

    optimizer = fresh_optimizer(model)
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
        f"XLA temporary, from shapes only (keras_dist's static plan): parameters "
        f"{_gib(device.parameters)}, gradients at most {_gib(device.gradients)} "
        f"(an engine that updates layer by layer holds fewer at once), "
        f"optimizer slots {_gib(device.optimizer_slots)}; {_memory_of(device)}.",
        "Largest per device:",
    ]
    for row in sorted(result.rows, key=lambda r: -r.bytes_per_device)[:5]:
        lines.append(
            f"  {row.path} {row.shape} {row.dtype} ({row.role}), layout "
            f"{row.axes}: {_gib(row.bytes_per_device)}"
        )
    devices = np.asarray(distribution.device_mesh.devices).reshape(-1).tolist()
    state = device.parameters + device.gradients + device.optimizer_slots
    if len(devices) == 1:
        lines.append(_more_devices(state, device.memory))
    else:
        lines.append("On the same devices (static, without activations):")
        for label, candidate in (
            ("kd.DataParallel()", lambda: DataParallel(devices=devices)),
            ("kd.FSDP()", lambda: FSDP(devices=devices)),
        ):
            lines.append(_static_candidate(model, label, candidate, optimizer))
    lines.append(
        "Remat lowers the activations, not the state above; so does a smaller "
        "batch. For XLA's own verdict, temporaries included, compile the "
        "candidates: keras_dist.plan_search(model_function, topology=..., "
        "batch_size=...) (JAX)."
    )
    return "\n".join(lines)


def _more_devices(state: int, memory: int | None) -> str:
    """What FSDP would need where the job has one device (it cannot split
    anything there)."""
    if memory is None:
        return (
            "One device: FSDP cannot split anything on it; how many devices it "
            "would need could not be said (the device's memory limit could not be "
            "read)."
        )
    chips = 2 ** math.ceil(math.log2(max(2.0, state / memory)))
    return (
        f"One device: FSDP cannot split anything on it; it would need at least "
        f"{chips} devices to hold this state (static, without activations)."
    )


def _static_candidate(model: Any, label: str, candidate: Any, optimizer: Any) -> str:
    from keras_dist.planner.plan import plan  # noqa: PLC0415

    try:
        other = plan(
            model, candidate(), on_indivisible="replicate", optimizer=optimizer
        )
    except Exception as error:  # a candidate that cannot be laid out
        return f"  {label}: cannot be laid out ({error})"
    first = other.devices[0]
    state = first.parameters + first.gradients + first.optimizer_slots
    if first.memory is None:
        verdict = "no memory limit to compare with"
    elif state <= first.memory:
        verdict = "would hold it"
    else:
        verdict = "too large"
    return f"  {label}: {_gib(state)} a device, {verdict}"
