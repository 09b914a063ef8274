"""A `keras_dist.plan` as rich tables and as a PNG bar chart."""

from __future__ import annotations

import io
from typing import Any

INSTALL = 'pip install "keras-dist[plan]"'


def _bytes(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return str(count)


def _import_rich() -> Any:
    try:
        import rich.console  # noqa: PLC0415
        import rich.table  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            f"Printing a plan needs the `rich` package: {INSTALL}"
        ) from error
    return rich


def _renderables(plan: Any) -> list[Any]:
    rich = _import_rich()
    mesh = ", ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    variables = rich.table.Table(
        title=f"Variables: mesh ({mesh}), batch axis {plan.batch_axis!r}"
    )
    for column in ("path", "shape", "dtype", "role", "key", "layout"):
        variables.add_column(column)
    variables.add_column("per device", justify="right")
    for row in plan.rows:
        variables.add_row(
            row.path,
            str(row.shape),
            row.dtype,
            row.role,
            row.key,
            str(row.axes),
            _bytes(row.bytes_per_device),
        )
    devices = rich.table.Table(title="Per device")
    for column in ("device", "parameters", "optimizer slots", "activations*"):
        devices.add_column(column, justify="right")
    devices.add_column("total", justify="right")
    devices.add_column("memory", justify="right")
    for device in plan.devices:
        devices.add_row(
            device.device,
            _bytes(device.parameters),
            _bytes(device.optimizer_slots),
            _bytes(device.activations),
            _bytes(device.total),
            _bytes(device.memory),
        )
    parts = [variables, devices]
    parts += [f"* {note}" for note in plan.notes]
    if plan.problems:
        problems = rich.table.Table(title=f"Problems ({len(plan.problems)})")
        problems.add_column("kind")
        problems.add_column("message")
        for problem in plan.problems:
            problems.add_row(problem.kind, problem.message)
        parts.append(problems)
    else:
        parts.append("No problems found.")
    return parts


def render_text(plan: Any, width: int = 160) -> str:
    rich = _import_rich()
    console = rich.console.Console(
        file=io.StringIO(), width=width, color_system=None, soft_wrap=False
    )
    for part in _renderables(plan):
        console.print(part)
    return console.file.getvalue()


def print_plan(plan: Any) -> None:
    rich = _import_rich()
    console = rich.console.Console()
    for part in _renderables(plan):
        console.print(part)


def plot_plan(plan: Any, path: str) -> str:
    try:
        # The figure draws on its own Agg canvas: no pyplot, so the user's
        # matplotlib backend and open figures are left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            f"Plotting a plan needs the `matplotlib` package: {INSTALL}"
        ) from error
    largest = max(
        [d.total for d in plan.devices] + [d.memory or 0 for d in plan.devices]
    )
    power = min(4, max(0, (max(largest, 1).bit_length() - 1) // 10))
    unit = ("B", "KiB", "MiB", "GiB", "TiB")[power]
    scale = 1024**power  # bytes per chart unit
    names = [d.device for d in plan.devices]
    positions = list(range(len(names)))
    parameters = [d.parameters / scale for d in plan.devices]
    slots = [d.optimizer_slots / scale for d in plan.devices]
    activations = [(d.activations or 0) / scale for d in plan.devices]
    figure = Figure(figsize=(max(6.0, 0.5 * len(names) + 2) + 3, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    axes.bar(positions, parameters, label="parameters")
    axes.bar(positions, slots, bottom=parameters, label="optimizer slots")
    bottoms = [p + s for p, s in zip(parameters, slots, strict=True)]
    axes.bar(positions, activations, bottom=bottoms, label="activations (estimate)")
    memory = [d.memory for d in plan.devices]
    if all(m is not None for m in memory):
        axes.step(
            [p - 0.5 for p in positions] + [positions[-1] + 0.5],
            [m / scale for m in memory] + [memory[-1] / scale],
            where="post",
            color="red",
            label="device memory",
        )
    axes.set_xticks(positions, names, rotation=90 if len(names) > 8 else 0)
    axes.set_ylabel(f"{unit} per device")
    axes.set_title(f"keras_dist plan: {len(plan.problems)} problem(s)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
