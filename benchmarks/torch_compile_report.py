"""What TorchDynamo makes of a compiled torch train step, for the entries.

`explain_fit_step(model, fit, step)` runs one `fit` of `model` (compiled with
`jit_compile=True`) whose step `step` goes through `torch._dynamo.explain`
instead of the compiled function: the same function Keras compiles (the
model's `train_step` on the batch). It returns the number of graphs, each
graph break's reason and the frames it came from (innermost last), and how
many breaks TorchDynamo could not resume after in the whole fit (it then runs
the frame eagerly; counted from `torch._dynamo.utils.counters`).

Explain resets TorchDynamo's caches: call it before the timed fits (their
warm-up compiles again).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import keras

_SITE = os.sep + "site-packages" + os.sep


def _short(filename: str) -> str:
    if _SITE in filename:
        return filename.split(_SITE, 1)[1]
    marker = os.sep + "keras_dist" + os.sep
    if marker in filename:
        return "keras_dist" + os.sep + filename.split(marker, 1)[1]
    return filename


class _ExplainStep(keras.callbacks.Callback):
    def __init__(self, step: int):
        super().__init__()
        self.step = step
        self.report: dict[str, Any] | None = None

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if batch != self.step:
            return
        import torch  # noqa: PLC0415

        model = self.model
        compiled = model.train_function

        def explained(data: list) -> dict:
            model.train_function = compiled
            output = torch._dynamo.explain(lambda d: model.train_step(d[0]))(data)
            self.report = {
                "graphs": output.graph_count,
                "graph_breaks": output.graph_break_count,
                "breaks": [
                    {
                        "reason": reason.reason.splitlines()[0],
                        "frames": [
                            f"{_short(frame.filename)}:{frame.lineno} ({frame.name})"
                            for frame in reason.user_stack
                        ][-4:],
                    }
                    for reason in output.break_reasons
                ],
            }
            return model.get_metrics_result()

        model.train_function = explained


def explain_fit_step(
    fit: Callable[[int, list], Any], *, steps: int = 4, step: int = 2
) -> dict[str, Any]:
    """Explain step `step` of a `fit(steps, callbacks)` (see the module)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    counters["graph_break"].clear()
    explain = _ExplainStep(step)
    fit(steps, [explain])
    report = explain.report or {}
    report["not_resumed"] = sum(
        count
        for reason, count in counters["graph_break"].items()
        if "Failed to handle graph break gracefully" in reason
    )
    return report


def print_report(name: str, report: dict[str, Any], log: Callable[[str], None]) -> None:
    log(
        f"{name}: torch._dynamo.explain of one step: {report.get('graphs')} graphs, "
        f"{len(report.get('breaks', []))} break reasons; breaks not resumed in "
        f"the fit: {report.get('not_resumed')}"
    )
    for found in report.get("breaks", []):
        log(f"  {found['reason']}")
        for frame in found["frames"]:
            log(f"      {frame}")
