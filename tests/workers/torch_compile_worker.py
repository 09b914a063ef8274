"""keras_dist's torch step compiled with `torch.compile` (`jit_compile=True`)
under DDP, against the same fit run eagerly: one rank of a PyTorch job.

Usage: python torch_compile_worker.py OUTPUT_JSON

Two models built from the same seed, one compiled with `jit_compile=True` and
one without, each `fit` for a few SGD steps through `kd.DataParallel()`. The
result holds both models' weights, their logs, and what TorchDynamo said about
the compiled step: every graph break's reason and the file and line it came
from (`torch._dynamo.explain` of the third step of a third fit, which
TorchDynamo traces as it traces a compiled one), and its count of breaks it
could not resume after (a step left to run eagerly).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import worker_seed  # noqa: E402

import keras_dist as kd  # noqa: E402

ROWS, BATCH, EPOCHS = 96, 16, 2  # 12 steps


def build(jit_compile: bool) -> keras.Model:
    worker_seed.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


class ExplainStep(keras.callbacks.Callback):
    """Runs step `step` of the fit through `torch._dynamo.explain` (the same
    function Keras compiles: the model's step on the batch), keeping its
    report."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step
        self.report: dict | None = None

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
                "breaks": [
                    {
                        "reason": reason.reason.splitlines()[0],
                        "frames": [
                            f"{frame.filename}:{frame.lineno}"
                            for frame in reason.user_stack
                        ],
                    }
                    for reason in output.break_reasons
                ],
            }
            return model.get_metrics_result()

        model.train_function = explained


class StepLogs(keras.callbacks.Callback):
    """Every step's logs, as the callbacks see them (the global values, summed
    over the processes within the step)."""

    def __init__(self):
        super().__init__()
        self.logs: list[dict] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.logs.append({key: float(value) for key, value in logs.items()})


def weights(model: keras.Model) -> list:
    return [np.asarray(w).tolist() for w in model.get_weights()]


def main() -> None:
    kd.initialize()
    import torch  # noqa: PLC0415
    from torch._dynamo.utils import counters  # noqa: PLC0415

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")

    def fit(
        model: keras.Model, *extra: keras.callbacks.Callback
    ) -> tuple[dict, list[dict]]:
        steps = StepLogs()
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel()), steps, *extra],
        )
        epochs = {
            key: [float(v) for v in values] for key, values in history.history.items()
        }
        return epochs, steps.logs

    counters.clear()
    compiled = build(jit_compile=True)
    compiled_logs, compiled_step_logs = fit(compiled)
    not_resumed = sum(
        count
        for reason, count in counters["graph_break"].items()
        if "Failed to handle graph break gracefully" in reason
    )
    eager = build(jit_compile=False)
    eager_logs, eager_step_logs = fit(eager)
    # A third model: explain one steady-state step (after the first, which
    # also looks for unused weights). `explain` traces the step with
    # TorchDynamo itself, whether Keras compiles the model or not (keras_dist's
    # step takes its compiled branches while TorchDynamo traces it): left
    # uncompiled, this model costs no second compilation of the same step.
    explain = ExplainStep(step=2)
    fit(build(jit_compile=False), explain)
    result = {
        "processes": kd.num_processes(),
        "compiled": weights(compiled),
        "eager": weights(eager),
        "compiled_logs": compiled_logs,
        "eager_logs": eager_logs,
        "compiled_step_logs": compiled_step_logs,
        "eager_step_logs": eager_step_logs,
        "not_resumed": not_resumed,
        "explain": explain.report,
    }
    with open(sys.argv[-1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
