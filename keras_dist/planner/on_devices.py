"""The step of a call that ran out of device memory, compiled again for the
devices it ran on, with what would fit there.

`keras_dist.OutOfDeviceMemoryError` asks this module first (JAX, where the
failing call's batch was seen): the step is compiled at that batch under the
distribution in use, on the real devices (nothing allocated), and XLA's
memory analysis says what it needs; then, within `MAX_COMPILES` compiles and
`TIME_BUDGET` seconds, the candidates that could fit on the same devices
(half the batch, remat, FSDP over the same devices, offloaded or bfloat16
optimizer state where the distribution takes them). Where the step cannot
be compiled (PyTorch, TensorFlow, a batch not seen) `explain` returns None
and the error falls back to the static plan, from shapes only.
"""

from __future__ import annotations

import inspect
import math
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.distribution.layer_settings import apply_layer_settings
from keras_dist.distribution.policies import FSDP

#: At most this many compiles (the failing step's included) a failed call
#: spends on its error message, and at most `TIME_BUDGET` seconds: no
#: candidate compile starts once they are spent.
MAX_COMPILES = 4
TIME_BUDGET = 60.0
_KINDS = {"fit": "train", "evaluate": "test", "predict": "predict"}
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?"
# The engines' words for what was needed and what there was.
_SHORTFALLS = (
    # XLA (TPU), at compile: "Used 15.80G of 15.75G hbm."
    re.compile(rf"Used {_NUMBER} of {_NUMBER} hbm", re.IGNORECASE),
    # "15.80G needed, 15.75G available"
    re.compile(rf"{_NUMBER}\s+needed,?\s+{_NUMBER}\s+available", re.IGNORECASE),
    # The runtime, at allocation: "Attempting to allocate 4.00G. That was
    # not possible. There are 2.31G free."
    re.compile(
        rf"allocate {_NUMBER}\b.*?There (?:are|is) {_NUMBER} free",
        re.IGNORECASE | re.DOTALL,
    ),
)
_ALLOCATING = re.compile(
    rf"(?:trying to allocate|Attempting to allocate)\s+{_NUMBER}", re.IGNORECASE
)


def _size(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()])


def gib(count: int | None) -> str:
    """`count` bytes in GiB, MiB or KiB, whichever reads best (None: a figure
    XLA's memory analysis did not give)."""
    if count is None:
        return "(not in XLA's memory analysis)"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count / 2**10:.1f} KiB"


def shortfall_in(text: str) -> tuple[int | None, int | None]:
    """What the engine's error `text` says was needed and was available per
    device, in bytes (None where it does not say). A failed allocation alone
    gives the buffer asked for as what was needed (at least)."""
    for pattern in _SHORTFALLS:
        match = pattern.search(text)
        if match:
            needed = _size(match.group(1), match.group(2))
            return needed, _size(match.group(3), match.group(4))
    match = _ALLOCATING.search(text)
    if match:
        return _size(match.group(1), match.group(2)), None
    return None, None


def device_limit(distribution: Any) -> int | None:
    """What a program may allocate on the least of the distribution's
    devices, as the engine reports it, or None (CPUs report no limit)."""
    adapter = get_adapter()
    devices = np.asarray(distribution.device_mesh.devices).reshape(-1).tolist()
    limits = [adapter.device_memory_bytes(str(device)) for device in devices]
    known = [limit for limit in limits if limit]
    return min(known) if known and len(known) == len(limits) else None


def _with_rows(batch: Any, rows: int) -> Any:
    """`batch` (shapes) with `rows` rows instead of its own."""

    def resized(leaf: Any) -> Any:
        if leaf is None:
            return None
        return type(leaf)((rows, *tuple(leaf.shape)[1:]), leaf.dtype)

    import keras  # noqa: PLC0415  (Keras' tree walks the backend's structs)

    return keras.tree.map_structure(resized, batch)


def _rows(batch: Any) -> int:
    import keras  # noqa: PLC0415

    leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
    return int(leaves[0].shape[0])


class _Compiler:
    """Compiles `kind` steps of `model` on the real devices, counting the
    compiles and the seconds against the budget."""

    def __init__(self, model: Any, kind: str):
        self.model = model
        self.kind = kind
        self.began = time.monotonic()
        self.count = 0

    @property
    def spent(self) -> float:
        return time.monotonic() - self.began

    def can(self) -> bool:
        return self.count < MAX_COMPILES and self.spent < TIME_BUDGET

    def __call__(self, distribution: Any, batch: Any) -> dict[str, Any]:
        self.count += 1
        adapter = get_adapter()
        undo = apply_layer_settings(
            self.model,
            distribution,
            warn=False,
            recomputes_state=getattr(adapter, "recomputes_layer_state", False),
        )
        try:
            steps = adapter.compile_steps(self.model, distribution, batch, (self.kind,))
            return steps[self.kind]
        except Exception as error:  # a candidate's failure is its verdict
            return {"error": f"{type(error).__name__}: {error}"}
        finally:
            undo()


def _needed(figures: dict[str, Any]) -> int | None:
    """The peak a compile says, or what XLA's refusal says it needed."""
    if figures.get("peak_bytes") is not None:
        return int(figures["peak_bytes"])
    return shortfall_in(figures.get("error") or "")[0]


def _verdict(needed: int | None, limit: int | None, figures: dict[str, Any]) -> str:
    if needed is None:
        error = " ".join(str(figures.get("error") or "no figure").split())
        return f"not compiled ({error[:200]})"
    if limit is None:
        return f"XLA needs {gib(needed)} a device"
    if needed <= limit:
        return f"fits: {gib(needed)} a device, {gib(limit - needed)} to spare"
    return f"does not fit: {gib(needed)} a device, {gib(needed - limit)} short"


def _takes(distribution: Any, name: str) -> bool:
    return name in inspect.signature(type(distribution).__init__).parameters


def _candidates(distribution: Any, devices: list) -> list[tuple[str, Callable]]:
    """(label, make) for each variant of `distribution` worth compiling on
    the same devices, in the order they are tried."""
    made: list[tuple[str, Callable[[], Any]]] = []
    if len(devices) > 1 and not isinstance(distribution, FSDP):
        made.append(
            (
                "kd.FSDP() on the same devices",
                lambda: FSDP(devices=devices, remat=distribution.remat),
            )
        )
    if distribution.remat is None:
        made.append(('remat="full"', lambda: distribution.with_options(remat="full")))
    savers = (("offload", "optimizer"), ("optimizer_state_dtype", "bfloat16"))
    for name, value in savers:
        if _takes(distribution, name) and getattr(distribution, name, None) is None:
            made.append((f"{name}={value!r}", _rebuilt(distribution, name, value)))
    return made


def _rebuilt(distribution: Any, name: str, value: Any) -> Callable[[], Any]:
    def make() -> Any:
        return distribution.with_options(**{name: value})

    return make


def _largest_batch(
    rows: int, needed: int, half_rows: int, half_needed: int, limit: int, shards: int
) -> int | None:
    """The largest batch (a multiple of `shards`) whose peak, linear in the
    rows between the two compiles, is within `limit`; None when the batch
    does not move the peak."""
    per_row = (needed - half_needed) / (rows - half_rows)
    if per_row <= 0:
        return None
    fixed = needed - per_row * rows
    largest = int((limit - fixed) // per_row)
    return (largest // shards) * shards if largest >= shards else 0


def explain(model: Any, distribution: Any, name: str, error: str) -> str | None:
    """The compiled account of `model`'s failed call `name` under
    `distribution` (see the module's docstring), or None when its step
    cannot be compiled here."""
    adapter = get_adapter()
    batch = adapter.last_batch_shapes()
    kind = _KINDS.get(name)
    if adapter.name != "jax" or batch is None or kind is None:
        return None
    devices = np.asarray(distribution.device_mesh.devices).reshape(-1).tolist()
    limit = device_limit(distribution)
    said_needed, said_available = shortfall_in(error)
    if limit is None:
        limit = said_available
    compiler = _Compiler(model, kind)
    figures = compiler(distribution, batch)
    needed = _needed(figures)
    rows = _rows(batch)
    mesh = distribution.device_mesh
    shape = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    lines = [
        f"{name} ran out of device memory under {distribution!r} ({len(devices)} "
        f"device(s), mesh {shape}), at a global batch of {rows}."
    ]
    lines.append(_shortfall_line(needed, limit, said_needed, said_available))
    if figures.get("peak_bytes") is not None:
        lines.append(
            f"XLA's memory analysis of the {kind} step compiled for these devices, "
            f"a device: arguments {gib(figures['argument_bytes'])} (variables, "
            f"optimizer state, the batch), temporaries {gib(figures['temp_bytes'])}"
            " (activations kept for the backward pass, gradients, workspace), "
            f"outputs {gib(figures['output_bytes'])}, less "
            f"{gib(figures['alias_bytes'])} the outputs reuse."
        )
    lines += _largest_lines(model, distribution)
    lines.append(
        f"On these devices (each compiled for them; at most {MAX_COMPILES} compiles "
        f"and {TIME_BUDGET:.0f} s, this error's budget):"
    )
    tried = []
    if rows >= 2 and compiler.can():
        half = rows // 2
        half_figures = compiler(distribution, _with_rows(batch, half))
        half_needed = _needed(half_figures)
        text = f"  batch {half} (half): {_verdict(half_needed, limit, half_figures)}"
        if None not in (needed, half_needed, limit):
            largest = _largest_batch(
                rows, needed, half, half_needed, limit, distribution.num_model_replicas
            )
            if largest is not None:
                text += (
                    f"; the largest batch that fits: about {largest} (the peak "
                    "linear in the batch between the two compiles)"
                )
        lines.append(text)
        tried.append("batch")
    left = []
    for label, make in _candidates(distribution, devices):
        if not compiler.can():
            left.append(label)
            continue
        try:
            candidate = make()
        except Exception as problem:  # a variant this distribution cannot be
            lines.append(f"  {label}: cannot be made ({problem})")
            continue
        result = compiler(candidate, batch)
        lines.append(f"  {label}: {_verdict(_needed(result), limit, result)}")
    if len(devices) == 1 or isinstance(distribution, FSDP):
        lines.append("  " + _fsdp_chips(needed, limit, len(devices)))
    if left:
        lines.append(
            f"  not compiled ({compiler.count} compiles in {compiler.spent:.0f} s "
            f"spent): {', '.join(left)}"
        )
    lines.append(
        "For XLA's verdict on more devices or other layouts: "
        "keras_dist.plan_search(model_function, topology=..., batch_size=...)."
    )
    return "\n".join(lines)


def _shortfall_line(
    needed: int | None,
    limit: int | None,
    said_needed: int | None,
    said_available: int | None,
) -> str:
    if said_needed is not None and said_available is not None:
        return (
            f"The engine said: {gib(said_needed)} needed, {gib(said_available)} "
            f"available ({gib(said_needed - said_available)} short)."
        )
    parts = []
    if said_needed is not None:
        parts.append(f"The engine could not allocate a buffer of {gib(said_needed)}")
    if needed is not None:
        parts.append(f"XLA needs {gib(needed)} a device for the whole step")
    else:
        parts.append(
            "XLA refused to compile the step again without saying how much it needed"
        )
    if limit is not None:
        if needed is not None:
            parts.append(
                f"the devices allow {gib(limit)} ({gib(needed - limit)} short)"
            )
        else:
            parts.append(f"the devices allow {gib(limit)}")
    else:
        parts.append(
            "the devices' limit could not be read (the engine reports none for "
            "them, as for CPU devices, and its error names none)"
        )
    return "; ".join(parts) + "."


def fresh_optimizer(model: Any) -> Any:
    """A new optimizer of `model`'s optimizer's class, or None: its slots are
    the same, and its config is not read from variables a failed call may
    have left without values (Keras' JAX trainer keeps them in its state)."""
    compiled = getattr(model, "optimizer", None)
    if compiled is None:
        return None
    return type(getattr(compiled, "inner_optimizer", compiled))()


def _largest_lines(model: Any, distribution: Any) -> list[str]:
    """The largest variables and optimizer slots a device holds, in the
    plan's words (from shapes: exact for variables)."""
    from keras_dist.planner.plan import plan  # noqa: PLC0415

    try:
        result = plan(
            model,
            distribution,
            on_indivisible="replicate",
            optimizer=fresh_optimizer(model),
        )
    except Exception as error:  # the plan is a help; never hide the OOM
        return [
            f"(The variables could not be planned: {type(error).__name__}: {error}.)"
        ]
    lines = ["Largest variables and optimizer slots, a device:"]
    for row in sorted(result.rows, key=lambda r: -r.bytes_per_device)[:5]:
        lines.append(
            f"  {row.path} {row.shape} {row.dtype} ({row.role}), layout "
            f"{row.axes}: {gib(row.bytes_per_device)}"
        )
    return lines


def _fsdp_chips(needed: int | None, limit: int | None, devices: int) -> str:
    """How many devices FSDP would need, the peak split evenly (a lower
    estimate: gathered layers and replicated parts are not split)."""
    if needed is None or limit is None:
        missing = " and ".join(
            what
            for what, figure in (
                ("XLA gave no peak for the step", needed),
                ("the devices' memory limit could not be read", limit),
            )
            if figure is None
        )
        return f"FSDP on more devices: how many could not be said ({missing})"
    chips = 2 ** math.ceil(math.log2(max(1.0, needed * devices / limit)))
    if chips <= devices:
        chips = devices * 2
    return (
        f"FSDP would need at least {chips} devices (the peak split evenly; this "
        f"job has {devices}): plan them with keras_dist.plan_search"
    )


__all__ = [
    "MAX_COMPILES",
    "TIME_BUDGET",
    "device_limit",
    "explain",
    "shortfall_in",
]
