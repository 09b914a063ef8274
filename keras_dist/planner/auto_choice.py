"""What `"auto"` chooses among a search's candidates, and how it says so.

    rule         among the candidates that fit each device with the
                 headroom: the fastest projected step; steps within `TIE`
                 of the fastest (or no step projected, as on CPUs) are a
                 tie, won by the simpler candidate (`simplicity`): first
                 what it adds to the step (nothing recomputed, then remat,
                 then offloaded optimizer state, then remat "offload"), then
                 the layout (DataParallel, then FSDP, then FSDP with a
                 sequence axis, then FSDP x TP by growing model axis): FSDP
                 without remat wins over DataParallel with remat, whose
                 recomputation costs more. bfloat16 optimizer state changes
                 the training's numbers: chosen only where nothing that
                 keeps them fits.
    row          `Choice`: the concrete distribution, its candidate, the
                 planned peak against the limit, the projected step, the
                 search's seconds, why, and the code that pins it
    agreement    a choice as numbers (`encode`, `decode`): process 0 decides
                 and the others read its numbers, so every process builds
                 the same distribution and the same row

Nothing here imports a backend: the search (`planner/search.py`) or the
static plan (`planner/plan.py`) has run already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from keras_dist.planner.candidates import (
    BATCH_AXIS,
    MODEL_AXIS,
    POLICIES,
    REMAT,
    SEQUENCE_AXIS,
    Candidate,
    keras_hub_backbone,
)

#: Projected steps within this share of the fastest are a tie (the
#: roofline is a lower bound: a smaller gap says nothing).
TIE = 0.02
#: How the choice was made: XLA's compile for these devices, or shapes only.
SOURCES = ("compiled", "shapes")
_GIB = 2**30
#: The nearest candidates the error of "nothing fits" lists.
SHOWN = 10


def in_gib(count: float) -> str:
    """`count` bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", _GIB), ("MiB", 2**20)):
        if abs(count) >= size:
            return f"{count / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{count / 2**10:.1f} KiB"


def simplicity(candidate: Candidate) -> tuple:
    """The order a tie is broken in (the module's rule): smaller is simpler."""
    saver = 0
    if candidate.remat is not None:
        saver = 3 if candidate.remat == "offload" else 1
    if candidate.offload:
        saver = max(saver, 2)
    return (
        saver,
        candidate.optimizer_state_dtype is not None,
        POLICIES.index(candidate.policy),
        SEQUENCE_AXIS in candidate.mesh,
        candidate.mesh.get(MODEL_AXIS, 1),
        REMAT.index(candidate.remat),
    )


def pick(rows: list[Any]) -> Any | None:
    """The row to train with among `rows` (each with `.candidate`, `.fits`
    and `.step_seconds`, as `SearchResult`s), by the module's rule, or None
    where none fits."""
    fitting = [row for row in rows if row.fits is True]
    exact = [row for row in fitting if not row.candidate.optimizer_state_dtype]
    pool = exact or fitting
    if not pool:
        return None
    steps = [row.step_seconds for row in pool if row.step_seconds is not None]
    if steps:
        fastest = min(steps)
        pool = [
            row
            for row in pool
            if row.step_seconds is not None and row.step_seconds <= fastest * (1 + TIE)
        ]
    return min(pool, key=lambda row: simplicity(row.candidate))


def pinned_code(candidate: Candidate, model: Any = None) -> str:
    """The keras_dist code that makes `candidate`'s distribution on every
    device of the job, to write in place of `"auto"` (`kd` is keras_dist)."""
    options = []
    if candidate.remat == "blocks":
        owner = "model.backbone" if getattr(model, "backbone", None) else "model"
        options.append(
            'remat=keras.RematScope(mode="list_of_layers", layer_names=[block.name '
            f"for block in {owner}.transformer_layers])"
        )
    elif candidate.remat is not None:
        options.append(f"remat={candidate.remat!r}")
    if candidate.offload:
        options.append(f"offload={candidate.offload!r}")
    if candidate.optimizer_state_dtype:
        options.append(f"optimizer_state_dtype={candidate.optimizer_state_dtype!r}")
    shape = tuple(candidate.mesh.values())
    names = tuple(candidate.mesh)
    mesh = f"kd.DeviceMesh({shape}, {names})"
    if candidate.policy == "fsdp_tp":
        backbone = model is not None and keras_hub_backbone(model) is not None
        layout = (
            "kd.layouts.for_keras_hub(model.backbone, mesh, "
            f'model_axis="{MODEL_AXIS}", data_axis="{BATCH_AXIS}")'
            if backbone
            else f'kd.layouts.tensor_parallel(model, mesh, model_axis="{MODEL_AXIS}")'
        )
        arguments = ", ".join([f"layout_map={layout}", *options])
        return f"mesh = {mesh}; kd.FSDP(mesh, {arguments})"
    if SEQUENCE_AXIS in candidate.mesh:
        options.insert(0, f'sequence_axis="{SEQUENCE_AXIS}"')
        arguments = ", ".join([mesh, *options])
    else:
        arguments = ", ".join(options)
    name = "DataParallel" if candidate.policy == "data_parallel" else "FSDP"
    return f"kd.{name}({arguments})"


@dataclass
class Choice:
    """What `"auto"` chose for a model: the row of its search.

    Attributes:
        distribution: the concrete keras_dist distribution trained with.
        candidate: its `Candidate` (policy, mesh, remat, offload, state dtype).
        peak_bytes: the planned peak a device (XLA's, or the static plan's
            total from shapes).
        limit_bytes: what a device may hold: its memory less the headroom.
        memory_bytes: a device's memory (given or reported).
        step_seconds: the projected step (None where none is projected).
        search_seconds: how long choosing took (on process 0).
        source: `"compiled"` (XLA's compile for these devices) or
            `"shapes"` (the static plan: PyTorch, TensorFlow).
        searched: candidates with a verdict (compiled, cached or screened).
        data_parallel_peak: DataParallel's planned peak, where it was planned.
        data_parallel_step: DataParallel's projected step, where projected.
    """

    distribution: Any
    candidate: Candidate
    peak_bytes: int | None
    limit_bytes: int
    memory_bytes: int
    step_seconds: float | None
    search_seconds: float
    source: str
    searched: int
    data_parallel_peak: int | None = None
    data_parallel_step: float | None = None
    code: str = field(default="")

    @property
    def policy(self) -> str:
        return self.candidate.label

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.candidate.mesh)

    @property
    def remat(self) -> str | None:
        return self.candidate.remat

    @property
    def offload(self) -> str | None:
        return self.candidate.offload

    @property
    def optimizer_state_dtype(self) -> str | None:
        return self.candidate.optimizer_state_dtype

    @property
    def description(self) -> str:
        return self.candidate.description

    @property
    def reason(self) -> str:
        """Why this one, in words."""
        if self.candidate.policy == "data_parallel" and self.candidate.plain:
            return "DataParallel fits, the simplest"
        limit = self.limit_bytes
        dp_peak = self.data_parallel_peak
        if dp_peak is not None and dp_peak > limit:
            return (
                f"DataParallel does not fit: {in_gib(dp_peak)} of {in_gib(limit)} a "
                "device"
            )
        dp_step = self.data_parallel_step
        if dp_step is not None and self.step_seconds is not None:
            return (
                f"projected faster than DataParallel: {self.step_seconds * 1e3:.3g} "
                f"against {dp_step * 1e3:.3g} ms a step"
            )
        return "DataParallel was not planned within the search's budget"

    @property
    def line(self) -> str:
        """The one line process 0 prints when the call starts."""
        peak = "-" if self.peak_bytes is None else in_gib(self.peak_bytes)
        step = (
            ""
            if self.step_seconds is None
            else f", projected step {self.step_seconds * 1e3:.3g} ms"
        )
        how = (
            f"compiled {self.searched} candidate(s) for these devices"
            if self.source == "compiled"
            else "from shapes (the static plan: this backend compiles no plan)"
        )
        return (
            f"keras_dist auto: {self.description} ({self.reason}; peak {peak} of "
            f"{in_gib(self.limit_bytes)} a device{step}); chosen in "
            f"{self.search_seconds:.1f} s, {how}. To pin it, use "
            f'{self.code} in place of "auto".'
        )


# -- agreement -------------------------------------------------------------------
#: `encode`'s length: every process gathers as many numbers.
WIDTH = 17
CHOSEN, NOTHING_FITS, FAILED = 1.0, 0.0, -1.0


def _or(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def _back(value: float) -> float | None:
    return None if value < 0 else value


def encode(choice: Choice) -> list[float]:
    """`choice` as `WIDTH` numbers (`decode` rebuilds all but the
    distribution)."""
    candidate = choice.candidate
    mesh = candidate.mesh
    return [
        CHOSEN,
        float(POLICIES.index(candidate.policy)),
        float(mesh.get(BATCH_AXIS, 1)),
        float(mesh.get(MODEL_AXIS, 0)),
        float(mesh.get(SEQUENCE_AXIS, 0)),
        float(REMAT.index(candidate.remat)),
        1.0 if candidate.offload else 0.0,
        1.0 if candidate.optimizer_state_dtype else 0.0,
        _or(choice.peak_bytes),
        float(choice.limit_bytes),
        float(choice.memory_bytes),
        _or(choice.step_seconds),
        float(choice.search_seconds),
        float(SOURCES.index(choice.source)),
        float(choice.searched),
        _or(choice.data_parallel_peak),
        _or(choice.data_parallel_step),
    ]


def status(numbers: list[float]) -> float:
    return numbers[0]


def decode(
    numbers: list[float], make: Callable[[Candidate], Any], model: Any = None
) -> Choice:
    """The `Choice` process 0 encoded, its distribution made by `make`."""
    mesh = {BATCH_AXIS: int(numbers[2])}
    if numbers[3]:
        mesh[MODEL_AXIS] = int(numbers[3])
    if numbers[4]:
        mesh[SEQUENCE_AXIS] = int(numbers[4])
    candidate = Candidate(
        POLICIES[int(numbers[1])],
        mesh,
        remat=REMAT[int(numbers[5])],
        offload="optimizer" if numbers[6] else None,
        optimizer_state_dtype="bfloat16" if numbers[7] else None,
    )
    peak = _back(numbers[8])
    dp_peak = _back(numbers[15])
    return Choice(
        make(candidate),
        candidate,
        None if peak is None else int(peak),
        int(numbers[9]),
        int(numbers[10]),
        _back(numbers[11]),
        numbers[12],
        SOURCES[int(numbers[13])],
        int(numbers[14]),
        None if dp_peak is None else int(dp_peak),
        _back(numbers[16]),
        code=pinned_code(candidate, model),
    )


def shortfalls(rows: list[Any], limit: int) -> list[str]:
    """The candidates that do not fit, nearest first, one line each."""
    lines = []
    short = [row for row in rows if row.shortfall_bytes is not None]
    for index, row in enumerate(short[:SHOWN], 1):
        peak = row.peak_bytes
        needed = (
            f"{in_gib(peak)} of {in_gib(limit)}"
            if peak is not None
            else "its variables and optimizer state alone, static plan"
        )
        lines.append(
            f"  {index}. {row.description}: {in_gib(row.shortfall_bytes)} short a "
            f"device ({needed})"
        )
    if len(short) > SHOWN:
        lines.append(f"  ... and {len(short) - SHOWN} more, further from fitting")
    return lines


__all__ = [
    "Choice",
    "SOURCES",
    "TIE",
    "WIDTH",
    "decode",
    "encode",
    "in_gib",
    "pick",
    "pinned_code",
    "shortfalls",
    "simplicity",
]
