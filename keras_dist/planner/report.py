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
            row.role if row.memory == "device" else f"{row.role} ({row.memory})",
            row.key,
            str(row.axes),
            _bytes(row.bytes_per_device),
        )
    devices = rich.table.Table(title="Per device")
    for column in (
        "device",
        "parameters",
        "gradients",
        "optimizer slots",
        "activations*",
    ):
        devices.add_column(column, justify="right")
    devices.add_column("total", justify="right")
    devices.add_column("memory", justify="right")
    host = any(device.host_optimizer_slots for device in plan.devices)
    if host:
        devices.add_column("slots in host memory", justify="right")
    for label, group in device_groups(plan):
        device = group[0]
        devices.add_row(
            label,
            _bytes(device.parameters),
            _bytes(device.gradients),
            _bytes(device.optimizer_slots),
            _bytes(device.activations),
            _bytes(device.total),
            _bytes(device.memory),
            *([_bytes(device.host_optimizer_slots)] if host else []),
        )
    parts: list[Any] = [verdict(plan), variables, devices]
    parts += [f"* {note}" for note in plan.notes]
    if plan.compiled is not None:
        parts += _compiled_renderables(rich, plan.compiled)
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


def verdict(plan: Any) -> str:
    """The plan's headline: whether it fits each device, by how much."""
    compiled = plan.compiled
    if compiled is not None:
        failed = [step for step in compiled.steps.values() if step.error]
        if failed:
            verdict_word = "Does not fit" if compiled.fits is False else "Failed"
            return (
                f"{verdict_word}: XLA refused the {failed[0].kind} step on "
                f"{compiled.topology}: {failed[0].error.splitlines()[0][:300]}"
            )
        if compiled.margin_bytes is not None:
            peak = compiled.memory - compiled.margin_bytes
            return _headline(peak, compiled.memory, f"compiled for {compiled.topology}")
        return (
            "Fits: unknown (the devices' memory is unknown; pass device_memory=). "
            f"XLA's peak per device: {_bytes(compiled.peak_bytes)}."
        )
    known = [d for d in plan.devices if d.memory is not None]
    if not known:
        most = max((d.total for d in plan.devices), default=0)
        return (
            f"Fits: unknown (the devices' memory is unknown; pass device_memory=). "
            f"Per device: {_bytes(most)} (static estimate)."
        )
    worst = min(known, key=lambda d: d.memory - d.total)
    return _headline(worst.total, worst.memory, "static estimate")


def _headline(needed: int, memory: int, how: str) -> str:
    if needed <= memory:
        return (
            f"Fits: {_bytes(needed)} of {_bytes(memory)} per device, "
            f"{_bytes(memory - needed)} to spare ({how})."
        )
    return (
        f"Does not fit: {_bytes(needed)} per device, {_bytes(memory)} there, "
        f"{_bytes(needed - memory)} short ({how})."
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value * 1e3:.3g} ms"


def _compiled_renderables(rich: Any, compiled: Any) -> list[Any]:
    title = (
        f"Compiled for {compiled.topology}: {compiled.devices} x "
        f"{compiled.device_kind}"
        + (
            f", {compiled.num_slices} slices (mesh axis {compiled.slice_axis!r} "
            "spans them)"
            if compiled.num_slices > 1
            else ""
        )
        + f", computing in {compiled.compute_dtype} (per device)"
    )
    table = rich.table.Table(title=title)
    for column in (
        "step",
        "peak (XLA's)",
        "host (XLA's)",
        "host traffic",
        "flops (XLA's)",
        "collectives (XLA's)",
    ):
        table.add_column(column, justify="right")
    for column in ("step time (projected)", "MFU (projected)", "compile"):
        table.add_column(column, justify="right")
    for step in compiled.steps.values():
        if step.error:
            table.add_row(
                step.kind,
                "refused",
                "",
                "",
                "",
                step.error[:200],
                "",
                "",
                f"{step.compile_seconds:.1f} s",
            )
            continue
        moved = ", ".join(
            f"{name} {_bytes(size)}"
            for name, size in step.collective_bytes.items()
            if size
        )
        table.add_row(
            step.kind,
            _bytes(step.peak_bytes),
            _bytes(step.host_peak_bytes),
            _host_traffic(step),
            f"{step.flops:.3g}",
            moved or "none",
            _seconds(step.step_seconds),
            "unknown" if step.mfu is None else _percent(100 * step.mfu),
            f"{step.compile_seconds:.1f} s",
        )
    return [table] + [f"* {note}" for note in compiled.notes]


def _host_traffic(step: Any) -> str:
    """What a step moves from the host to the device and back."""
    if step.host_to_device_bytes is None or step.device_to_host_bytes is None:
        return "unknown"
    if not step.host_to_device_bytes and not step.device_to_host_bytes:
        return "none"
    return (
        f"{_bytes(step.host_to_device_bytes)} in, "
        f"{_bytes(step.device_to_host_bytes)} out"
    )


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


def _percent(share: float) -> str:
    if share >= 10:
        return f"{share:.0f}%"
    return f"{share:.1f}%" if share >= 1 else f"{share:.2g}%"


def device_groups(plan: Any) -> list[tuple[str, list[Any]]]:
    """The plan's devices grouped by what they hold (every layout splits
    evenly, so usually one group): `(label, devices)` per distinct total,
    labelled `"cpu:0"`, `"cpu:0, cpu:1"` or `"cpu:0 … cpu:7 (8 devices)"`."""
    groups: dict[tuple, list[Any]] = {}
    for device in plan.devices:
        key = (
            device.parameters,
            device.gradients,
            device.optimizer_slots,
            device.activations,
            device.memory,
        )
        groups.setdefault(key, []).append(device)
    labelled = []
    for devices in groups.values():
        names = [d.device for d in devices]
        if len(names) <= 2:
            label = ", ".join(names)
        else:
            label = f"{names[0]} … {names[-1]} ({len(names)} devices)"
        labelled.append((label, devices))
    return labelled


#: A device memory more than this many times the tallest bar is written on
#: the chart instead of drawn, so that the bars stay visible.
MEMORY_OFF_CHART = 4.0


def plot_plan(plan: Any, path: str) -> str:
    """Write `plan_figure(plan)` to `path` as a PNG; returns `path`."""
    plan_figure(plan).savefig(path, format="png", bbox_inches="tight")
    return path


def plan_figure(plan: Any) -> Any:
    """A matplotlib `Figure` of the plan: one stacked bar (parameters,
    gradients, optimizer slots, activations) per group of devices that hold the same,
    each size written on it, the device memory drawn as a line when within
    reach of the bars and written above them when it dwarfs them."""
    try:
        # The figure draws on its own Agg canvas: no pyplot, so the user's
        # matplotlib backend and open figures are left alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(
            f"Plotting a plan needs the `matplotlib` package: {INSTALL}"
        ) from error
    groups = device_groups(plan)
    firsts = [devices[0] for _, devices in groups]
    tallest = max([d.total for d in firsts] + [1])
    memories = [d.memory for d in firsts]
    known = [m for m in memories if m is not None]
    # The memory is drawn when it is within reach of the bars; a budget that
    # dwarfs them is written instead, so the bars keep the chart's height.
    draw_memory = bool(known) and max(known) <= MEMORY_OFF_CHART * tallest
    top = max([tallest] + (known if draw_memory else []))
    power = min(4, max(0, (max(top, 1).bit_length() - 1) // 10))
    unit = ("B", "KiB", "MiB", "GiB", "TiB")[power]
    scale = 1024**power  # bytes per chart unit
    positions = list(range(len(groups)))
    segments = [
        ("parameters", [d.parameters for d in firsts]),
        ("gradients", [d.gradients for d in firsts]),
        ("optimizer slots", [d.optimizer_slots for d in firsts]),
        ("activations (estimate)", [d.activations or 0 for d in firsts]),
    ]
    if len(firsts) == 1:  # every size in the legend, the thin ones too
        segments = [(f"{name}: {_bytes(v[0])}", v) for name, v in segments]
    if all(d.activations is None for d in firsts):
        segments[2] = (
            "activations: no estimate (see the plan's notes)",
            segments[2][1],
        )
    figure = Figure(figsize=(max(7.0, 1.6 * len(groups) + 2), 5.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    bottoms = [0.0] * len(groups)
    for label, values in segments:
        heights = [v / scale for v in values]
        bars = axes.bar(positions, heights, bottom=bottoms, width=0.6, label=label)
        # A segment's size inside it, where it is tall enough to hold the text.
        axes.bar_label(
            bars,
            labels=[
                _bytes(v) if v and v / scale >= 0.08 * top / scale else ""
                for v in values
            ],
            label_type="center",
            fontsize=8,
        )
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for position, device in zip(positions, firsts, strict=True):
        text = _bytes(device.total)
        if device.memory is not None:
            share = _percent(100 * device.total / device.memory)
            text += f"\n{share} of {_bytes(device.memory)}"
        over = device.memory is not None and device.total > device.memory
        axes.annotate(
            text,
            (position, device.total / scale),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            color="red" if over else "black",
            fontweight="bold" if over else "normal",
        )
    if draw_memory:
        for position, memory in zip(positions, memories, strict=True):
            if memory is not None:
                axes.hlines(
                    memory / scale,
                    position - 0.4,
                    position + 0.4,
                    colors="red",
                    label="device memory" if position == 0 else None,
                )
    elif known:
        axes.text(
            0.5,
            0.98,
            f"device memory: {_bytes(max(known))},\nfar above the bars (not to scale)",
            transform=axes.transAxes,
            ha="center",
            va="top",
            color="red",
            fontsize=9,
        )
    # Room above the bars for their labels (and the memory's, when written).
    axes.set_ylim(0, top / scale * (1.25 if draw_memory or not known else 1.5))
    axes.set_xticks(positions, [label for label, _ in groups])
    axes.set_xlim(-0.7, len(groups) - 0.3)
    axes.set_ylabel(f"{unit} per device")
    mesh = ", ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    axes.set_title(f"keras_dist plan: mesh ({mesh}), {len(plan.problems)} problem(s)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    return figure
