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


@dataclass(frozen=True)
class DeviceTotals:
    """Bytes one device holds; `memory` is None when unknown."""

    device: str
    parameters: int
    optimizer_slots: int
    activations: int | None
    memory: int | None

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_slots + (self.activations or 0)


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
