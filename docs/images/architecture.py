"""Draw the architecture page's two pictures as hand-laid SVG (standard library).

    python docs/images/architecture.py      # writes layers.svg and fit-path.svg here

The SVG files are committed; run this again after changing the layers or the path
of a `fit` call, and look at the result (e.g. `rsvg-convert -o /tmp/x.png
docs/images/layers.svg`).
"""

from __future__ import annotations

import pathlib
from xml.sax.saxutils import escape

HERE = pathlib.Path(__file__).resolve().parent
SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"

# Fill and stroke per group of layers.
COLORS = {
    "public": ("#dbeafe", "#1d4ed8"),
    "feature": ("#dcfce7", "#15803d"),
    "core": ("#fef3c7", "#b45309"),
    "backend": ("#f3e8ff", "#7e22ce"),
    "floor": ("#e5e7eb", "#374151"),
}

# (name, what it holds, group), top to bottom: each imports only from below.
LAYERS = [
    (
        "__init__.py  cli.py",
        "kd.* (the public API), the keras-dist command, __main__.py",
        "public",
    ),
    ("callback.py  trainer.py", "DistributeCallback, the Trainer mixin", "public"),
    ("schedules  flops  callbacks/", "public helpers", "public"),
    (
        "checkpoint/",
        "Checkpoint, restore, export; store, engines, preemption, keys",
        "feature",
    ),
    (
        "training/",
        "session.py: turn a run on and off; saving.py: process 0 writes every file",
        "feature",
    ),
    (
        "planner/",
        "plan (layouts and memory from shapes), plan_search (compiled candidates)",
        "feature",
    ),
    (
        "layouts.py",
        "the layout presets: tensor_parallel, for_keras_hub",
        "core",
    ),
    (
        "distribution/",
        "mesh, layout_map, policies, state, remat: what the user describes",
        "core",
    ),
    (
        "runtime/",
        "api (initialize, devices, processes), device_simulation",
        "core",
    ),
    (
        "backends/",
        "base.py + jax/ torch/ tensorflow/: the only code that imports a backend",
        "backend",
    ),
    ("faults/", "heartbeat (each rank's progress), lifecycle (its end)", "floor"),
    (
        "keras_compat/",
        "every touch of Keras private API + the probe, one module per concern",
        "floor",
    ),
    (
        "common/",
        "step_rows, row_aware, batch_norm, padding, random_streams, job, validation",
        "floor",
    ),
    (
        "cluster/",
        "stdlib only: environments, launcher, hang_doctor, job_dir, roll_call, "
        "rendezvous",
        "floor",
    ),
]


def _text(
    x,
    y,
    content,
    *,
    size=13,
    family=SANS,
    weight="normal",
    anchor="start",
    fill="#111827",
    style="normal",
):
    return (
        f'<text x="{x}" y="{y}" font-family="{family}" font-size="{size}" '
        f'font-weight="{weight}" font-style="{style}" text-anchor="{anchor}" '
        f'fill="{fill}">{escape(content)}</text>'
    )


def _rect(x, y, width, height, fill, stroke, *, radius=6, dash=None):
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<rect x="{x}" y="{y}" width="{width}" height="{height}" rx="{radius}" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"{dashes}/>'
    )


def _svg(width, height, body, title):
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            "<defs>",
            '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" '
            'markerHeight="8" orient="auto-start-reverse">'
            '<path d="M 0 0 L 10 5 L 0 10 z" fill="#111827"/></marker>',
            "</defs>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
            *body,
            "</svg>",
            "",
        ]
    )


def layers() -> str:
    width, left, box_width, row, gap = 1010, 20, 880, 40, 8
    top = 56
    body = [
        _text(
            left, 28, "keras_dist/: the layers, top to bottom", size=18, weight="bold"
        ),
        _text(
            left,
            46,
            "each imports only from the layers below it "
            "(tests/test_package_rules.py enforces it)",
            size=13,
            fill="#374151",
        ),
    ]
    for index, (name, what, group) in enumerate(LAYERS):
        fill, stroke = COLORS[group]
        y = top + index * (row + gap)
        body.append(_rect(left, y, box_width, row, fill, stroke))
        body.append(_text(left + 12, y + 25, name, size=14, family=MONO, weight="bold"))
        body.append(_text(left + 320, y + 25, what, size=12.5, fill="#1f2937"))
    bottom = top + len(LAYERS) * (row + gap) - gap
    # The direction of imports.
    arrow_x = left + box_width + 45
    body.append(
        f'<line x1="{arrow_x}" y1="{top + 6}" x2="{arrow_x}" y2="{bottom - 4}" '
        'stroke="#111827" stroke-width="2.5" marker-end="url(#arrow)"/>'
    )
    middle = (top + bottom) // 2
    body.append(
        f'<text x="{arrow_x + 22}" y="{middle}" font-family="{SANS}" font-size="14" '
        f'text-anchor="middle" fill="#111827" '
        f'transform="rotate(90 {arrow_x + 22} {middle})">imports point down only</text>'
    )
    # The backends' narrower rule, and the one module outside the layers.
    note_y = bottom + 34
    body.append(
        _text(
            left,
            note_y,
            "backends/ imports only faults/, keras_compat/, "
            "common/ and cluster/; only backends/<name>/ imports jax, torch "
            "or tensorflow.",
            size=12.5,
            fill="#7e22ce",
        )
    )
    body.append(
        _text(
            left,
            note_y + 20,
            "_version.py (__version__) imports nothing; "
            "__init__ and the checkpoint manifest read it.",
            size=12.5,
            fill="#374151",
        )
    )
    legend_y = note_y + 48
    legend = [
        ("public", "public API"),
        ("feature", "features"),
        ("core", "what the user describes, the job"),
        ("backend", "backends"),
        ("floor", "shared floor: asks nobody above"),
    ]
    x = left
    for group, label in legend:
        fill, stroke = COLORS[group]
        body.append(_rect(x, legend_y - 12, 16, 16, fill, stroke, radius=3))
        body.append(_text(x + 22, legend_y + 1, label, size=12.5))
        x += 30 + int(len(label) * 7.2)
    return _svg(width, legend_y + 20, body, "The layers of keras_dist")


# The lifelines of one fit call, left to right: (title, subtitle).
LANES = [
    ("your script", ""),
    ("Keras", "Model.fit, CallbackList"),
    ("DistributeCallback", "callback.py"),
    ("DistributedRun", "training/session.py"),
    ("the backend's adapter", "backends/<name>/"),
]


def fit_path() -> str:
    width, lane_width, left, head = 1180, 224, 30, 50
    centers = [left + lane_width // 2 + i * lane_width for i in range(len(LANES))]
    body = [
        _text(
            left,
            28,
            "One fit call's path: callback \u2192 session \u2192 adapter \u2192 Keras",
            size=18,
            weight="bold",
        ),
    ]
    for (title, subtitle), center in zip(LANES, centers, strict=True):
        fill, stroke = (
            COLORS["public"]
            if title in ("your script", "Keras")
            else (
                COLORS["feature"]
                if title != "the backend's adapter"
                else COLORS["backend"]
            )
        )
        body.append(_rect(center - 100, head, 200, 46, fill, stroke))
        body.append(
            _text(center, head + 20, title, size=14, weight="bold", anchor="middle")
        )
        body.append(
            _text(
                center,
                head + 37,
                subtitle,
                size=11.5,
                family=MONO,
                anchor="middle",
                fill="#374151",
            )
        )

    steps = []  # (from lane, to lane, label lines, note lines or None)
    y = head + 92

    def message(source, target, label, *, dashed=False, note=None, note_lane=None):
        nonlocal y
        steps.append((source, target, label, dashed, note, note_lane, y))
        lines = 1 + (len(note) if note else 0)
        y += 30 + (18 * len(note) + 24 if note else 22)
        return lines

    message(0, 1, ["model.fit(..., callbacks=[kd.DistributeCallback(d)])"])
    message(1, 2, ["CallbackList.set_model \u2192 DistributeCallback.set_model"])
    message(
        2,
        3,
        ["DistributedRun(model, d).start()"],
        note=[
            "sets the global distribution,",
            "installs the one writer (process 0 writes),",
            "starts the heartbeat",
        ],
        note_lane=3,
    )
    message(
        3,
        4,
        ["backends.get_adapter().activate(model, distribution)"],
        note=[
            "lays out the variables built before,",
            "installs keras_dist's step functions through keras_compat/,",
            "routes each epoch's batches through its input_adapter:",
            "this process' shard of the global batch, padded, padding masked",
        ],
        note_lane=4,
    )
    loop_top = y - 8
    message(1, 4, ["each batch: Keras' own fit loop calls the installed step"])
    message(
        4,
        1,
        ["runs Keras' train_step (or yours), distributed"],
        note=[
            "common/step_rows tells metrics and losses",
            "which rows are real: logs are the exact global values",
        ],
        note_lane=1,
    )
    loop_bottom = y - 14
    message(1, 3, ["the call ends (or raises): DistributedRun.stop()"])
    message(3, 4, ["adapter.deactivate(): a plain Keras model again"])
    height = y + 10

    for center in centers:
        body.append(
            f'<line x1="{center}" y1="{head + 46}" x2="{center}" y2="{height - 14}" '
            'stroke="#9ca3af" stroke-width="1.5" stroke-dasharray="5 4"/>'
        )
    body.append(
        _rect(
            left + 8,
            loop_top,
            width - 2 * left - 16,
            loop_bottom - loop_top,
            "none",
            "#6b7280",
            radius=4,
            dash="7 4",
        )
    )
    body.append(
        _text(
            left + 16,
            loop_top + 16,
            "loop: every step of every epoch",
            size=12,
            style="italic",
            fill="#4b5563",
        )
    )

    for number, (source, target, label, _dashed, note, note_lane, top) in enumerate(
        steps, start=1
    ):
        start, end = centers[source], centers[target]
        arrow_y = top + 22
        body.append(
            f'<line x1="{start}" y1="{arrow_y}" '
            f'x2="{end + (-6 if end > start else 6)}" y2="{arrow_y}" '
            'stroke="#111827" stroke-width="1.8" '
            'marker-end="url(#arrow)"/>'
        )
        text = f"{number}. {label[0]}"
        text_width = len(text) * 7.6
        # Start at the left end of the arrow, but stay inside the picture.
        label_x = min(min(start, end) + 10, width - 12 - text_width)
        body.append(
            f'<rect x="{label_x - 3}" y="{arrow_y - 21}" '
            f'width="{text_width + 6}" height="18" fill="#ffffff"/>'
        )
        body.append(_text(label_x, arrow_y - 7, text, size=12.5, family=MONO))
        if note:
            center = centers[note_lane]
            note_width = max(len(line) for line in note) * 6.9 + 20
            note_x = min(center + 10, width - left - note_width)
            if note_lane == 1:
                note_x = center + 10
            note_top = arrow_y + 8
            body.append(
                _rect(
                    note_x,
                    note_top,
                    note_width,
                    18 * len(note) + 8,
                    "#fffbeb",
                    "#d97706",
                    radius=4,
                )
            )
            for line_number, line in enumerate(note):
                body.append(
                    _text(
                        note_x + 10,
                        note_top + 18 + 18 * line_number,
                        line,
                        size=12,
                        fill="#78350f",
                    )
                )
    return _svg(width, height, body, "One fit call through keras_dist")


def main() -> None:
    (HERE / "layers.svg").write_text(layers())
    (HERE / "fit-path.svg").write_text(fit_path())


if __name__ == "__main__":
    main()
