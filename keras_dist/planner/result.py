"""What `keras_dist.plan` returns: rows, per-device totals and problems."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """Something in a plan that fails, goes silently wrong or does not fit.

    `kind` is one of `"indivisible"`, `"unmatched-key"`, `"multiple-keys"`,
    `"swapped-axes"`, `"mixed-roles"`, `"too-many-axes"`, `"unbuilt"` (layers
    whose variables the plan could not see) and `"out-of-memory"`; `paths`
    names the variables (or keys, or layers) concerned.
    """

    kind: str
    message: str
    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class VariableRow:
    """One variable (or optimizer slot) of the plan."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "trainable", "non-trainable" or "optimizer"
    key: str  # the LayoutMap key that lays it out, or "unmatched"
    axes: tuple[str | None, ...]
    total_bytes: int
    bytes_per_device: int
    # Where it lives: "device", or "pinned_host" for an optimizer slot that
    # the distribution's `offload="optimizer"` keeps in host memory.
    memory: str = "device"


@dataclass(frozen=True)
class DeviceTotals:
    """Bytes one device holds at the optimizer's update, when the most is
    alive at once: the variables, a gradient for each trainable one (in its
    dtype, laid out as it is), the optimizer's slots and the activations'
    estimate. `memory` is None when unknown. `host_optimizer_slots`: the
    slots this device's part of which lives in pinned host memory
    (`offload="optimizer"`), not counted in `total`."""

    device: str
    parameters: int
    optimizer_slots: int
    activations: int | None
    memory: int | None
    gradients: int = 0
    host_optimizer_slots: int = 0

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_slots
            + (self.activations or 0)
        )


@dataclass(frozen=True)
class CompiledStep:
    """What XLA says of one compiled step (`"train"`, `"test"`,
    `"predict"`), per device, and the roofline's projection of its time.

    `peak_bytes` is XLA's arguments + outputs + temporaries + generated code,
    less the buffers the outputs alias (the donated state), in the device's
    memory; `host_peak_bytes` the same in its host's pinned memory (state
    offloaded there; `host_argument_bytes`, `host_output_bytes`,
    `host_temp_bytes` its parts). `host_to_device_bytes` and
    `device_to_host_bytes` are what one step moves between the two, read from
    the compiled program's transfers (where XLA writes only the program's
    signature, as on CPUs: its pinned_host arguments read once and outputs
    written once). `device_traffic_bytes` is what must cross the device's
    memory at least once a step: the arguments read and the outputs written.
    `flops` and `bytes_accessed` are XLA's cost analysis of one step
    (`bytes_accessed` counts each operation's operands and results as if
    nothing were fused: more than the step moves). `collective_bytes` is
    read from the compiled program: per kind, the bytes of the buffers its
    collectives work on (`collective_counts`: how many); `"cross-slice"` is
    what each device hands the data-center network (several slices). `seconds` is the
    roofline's time for each of `"compute"`, `"memory"`, `"host"`,
    `"interconnect"` and `"network"` (None where the chip's figure is
    unknown); `step_seconds` the longest, a lower bound of the step. `error`
    is XLA's words when it refused to compile the step (out of memory, say):
    the figures are then None.
    """

    kind: str
    compile_seconds: float
    peak_bytes: int | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None
    alias_bytes: int | None = None
    host_peak_bytes: int | None = None
    host_argument_bytes: int | None = None
    host_output_bytes: int | None = None
    host_temp_bytes: int | None = None
    device_traffic_bytes: int | None = None
    host_to_device_bytes: int | None = None
    device_to_host_bytes: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    collective_bytes: dict[str, int] = field(default_factory=dict)
    collective_counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float | None] = field(default_factory=dict)
    step_seconds: float | None = None
    mfu: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class CompiledPlan:
    """`keras_dist.plan(..., topology=...)`'s compiled steps on the topology.

    The train step's figures are repeated as attributes (`peak_bytes`,
    `host_peak_bytes`, `host_traffic_bytes`, `flops`, `collective_bytes`,
    `step_seconds`, `mfu`); `steps` has every
    step compiled. `memory` is one device's memory (the chip's HBM), None
    when unknown; `fits` whether the train step's peak is within it (None
    when either is unknown) and `margin_bytes` by how much (negative: short).
    `slice_axis` is the mesh axis that spans the slices (its collectives
    cross the data-center network), None on one slice.
    """

    topology: str
    device_kind: str
    devices: int
    num_slices: int
    compute_dtype: str
    steps: dict[str, CompiledStep]
    memory: int | None
    notes: list[str] = field(default_factory=list)
    slice_axis: str | None = None

    @property
    def train(self) -> CompiledStep:
        return self.steps.get("train") or next(iter(self.steps.values()))

    @property
    def peak_bytes(self) -> int | None:
        return self.train.peak_bytes

    @property
    def host_peak_bytes(self) -> int | None:
        return self.train.host_peak_bytes

    @property
    def host_traffic_bytes(self) -> int | None:
        """Bytes the train step moves between the host's pinned memory and
        the device, both ways together."""
        train = self.train
        if train.host_to_device_bytes is None or train.device_to_host_bytes is None:
            return None
        return train.host_to_device_bytes + train.device_to_host_bytes

    @property
    def flops(self) -> float | None:
        return self.train.flops

    @property
    def collective_bytes(self) -> dict[str, int]:
        return self.train.collective_bytes

    @property
    def step_seconds(self) -> float | None:
        return self.train.step_seconds

    @property
    def mfu(self) -> float | None:
        return self.train.mfu

    @property
    def margin_bytes(self) -> int | None:
        peaks = [s.peak_bytes for s in self.steps.values() if s.peak_bytes is not None]
        if self.memory is None or not peaks:
            return None
        return self.memory - max(peaks)

    @property
    def fits(self) -> bool | None:
        if any(_out_of_memory(step.error) for step in self.steps.values()):
            return False
        margin = self.margin_bytes
        return None if margin is None else margin >= 0


def _out_of_memory(error: str | None) -> bool:
    return bool(error) and any(
        word in error.lower()
        for word in ("resource_exhausted", "out of memory", "exceeds the memory")
    )


@dataclass
class Plan:
    """What `keras_dist.plan` found. Print it, `to_dict()` it or `plot()` it."""

    distribution: str
    mesh: dict[str, int]
    batch_axis: str
    rows: list[VariableRow]
    devices: list[DeviceTotals]
    problems: list[Problem]
    notes: list[str] = field(default_factory=list)
    compiled: CompiledPlan | None = None
    # The distribution object laid out (made on the topology's mesh when
    # `distribution` was a function of it): ready for DistributeCallback.
    made_distribution: Any = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool | None:
        """Whether the job fits each device's memory: the compiled plan's
        verdict when there is one, else the static totals' (None when the
        memory is unknown)."""
        if self.compiled is not None:
            return self.compiled.fits
        known = [d for d in self.devices if d.memory is not None]
        if not known:
            return None
        return all(d.total <= d.memory for d in known)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready dicts and lists."""
        return {
            "distribution": self.distribution,
            "mesh": dict(self.mesh),
            "batch_axis": self.batch_axis,
            "variables": [
                {**row.__dict__, "shape": list(row.shape), "axes": list(row.axes)}
                for row in self.rows
            ],
            "devices": [{**d.__dict__, "total": d.total} for d in self.devices],
            "problems": [
                {"kind": p.kind, "message": p.message, "paths": list(p.paths)}
                for p in self.problems
            ],
            "notes": list(self.notes),
            "fits": self.fits,
            "compiled": None
            if self.compiled is None
            else _compiled_dict(self.compiled),
        }

    def __str__(self) -> str:
        from keras_dist.planner.report import render_text  # noqa: PLC0415

        return render_text(self)

    def print(self) -> None:
        """Print the tables (needs `rich`: `pip install "keras-dist[plan]"`)."""
        from keras_dist.planner.report import print_plan  # noqa: PLC0415

        print_plan(self)

    def plot(self, path: str) -> str:
        """Write a PNG bar chart of the parameters, optimizer slots and
        activations (stacked, each size written on it) of each group of
        devices that hold the same (one bar for an evenly split mesh), with
        their memory as a line when known (written instead of drawn when it
        dwarfs the bars). Needs `matplotlib`. Returns `path`."""
        from keras_dist.planner.report import plot_plan  # noqa: PLC0415

        return plot_plan(self, path)


def _compiled_dict(compiled: CompiledPlan) -> dict[str, Any]:
    return {
        "topology": compiled.topology,
        "device_kind": compiled.device_kind,
        "devices": compiled.devices,
        "num_slices": compiled.num_slices,
        "slice_axis": compiled.slice_axis,
        "compute_dtype": compiled.compute_dtype,
        "memory": compiled.memory,
        "fits": compiled.fits,
        "margin_bytes": compiled.margin_bytes,
        "host_peak_bytes": compiled.host_peak_bytes,
        "host_traffic_bytes": compiled.host_traffic_bytes,
        "steps": {kind: dict(step.__dict__) for kind, step in compiled.steps.items()},
        "notes": list(compiled.notes),
    }
