"""What the Ray tests run on Ray Train workers (imported there by name).

Every worker feeds the same 40 rows; keras_dist gives each process its part of
each global batch of 8. The one-process reference is the same `fit` without
keras_dist.
"""

from __future__ import annotations

import json
import pathlib
import time

import keras
import numpy as np
from ray.train import UserCallback

ROWS = 40
BATCH = 8  # global: 5 steps an epoch
EPOCHS = 2
# How long a paused worker waits for Ray to end its group.
PAUSE_SECONDS = 120


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    return x, y


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def fit(model: keras.Model, callbacks: list) -> keras.callbacks.History:
    x, y = data()
    keras.utils.set_random_seed(0)  # the shuffle: process 0's draw wins
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )


def reference_weights() -> list[np.ndarray]:
    """One process, no keras_dist, the same global batch."""
    model = build_model()
    fit(model, [])
    return model.get_weights()


class _Attempt(keras.callbacks.Callback):
    """Records the step `fit` starts at (after kd.Checkpoint restored) and the
    group's size. With `pause_at` (`{"<processes>": step}`), the worker of
    rank 0 of a group of that size writes `paused-<processes>` after that step
    and waits there (at most `PAUSE_SECONDS`) for the test to change the
    cluster: Ray then ends the group."""

    def __init__(self, output: pathlib.Path, rank: int, config: dict) -> None:
        super().__init__()
        self.output, self.rank, self.config = output, rank, config

    def _step(self) -> int:
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_begin(self, logs=None):
        import keras_dist as kd  # noqa: PLC0415

        self.processes = kd.num_processes()
        with open(self.output / f"starts-{self.rank}.txt", "a") as file:
            file.write(f"{self._step()}\n")
        with open(self.output / f"sizes-{self.rank}.txt", "a") as file:
            file.write(f"{self.processes}\n")

    def on_train_batch_end(self, batch, logs=None):
        pause_at = self.config.get("pause_at", {}).get(str(self.processes))
        marker = self.output / f"paused-{self.processes}"
        if self.rank == 0 and self._step() == pause_at and not marker.exists():
            marker.write_text(str(self._step()))
            deadline = time.monotonic() + PAUSE_SECONDS
            while time.monotonic() < deadline:
                time.sleep(0.05)


def train(config: dict) -> None:
    """The training function of a Ray Train worker: the same body as under
    `keras-dist launch`."""
    from keras_dist_ray import ReportCallback  # noqa: PLC0415

    import keras_dist as kd  # noqa: PLC0415

    kd.initialize()
    output = pathlib.Path(config["output"])
    rank = kd.process_id()
    model = build_model()
    callbacks: list = [kd.DistributeCallback(kd.DataParallel())]
    if config.get("checkpoint_dir"):
        checkpoint = kd.Checkpoint(
            config["checkpoint_dir"],
            save_freq=config["save_freq"],
            save_on_background=config.get("save_on_background", True),
        )
        callbacks += [checkpoint, ReportCallback(checkpoint)]
    else:
        callbacks.append(ReportCallback())
    callbacks.append(_Attempt(output, rank, config))
    history = fit(model, callbacks)
    weights = model.get_weights()
    np.savez(output / f"weights-{rank}.npz", *weights)
    (output / f"result-{rank}.json").write_text(
        json.dumps(
            {
                "processes": kd.num_processes(),
                "devices": kd.list_devices(),
                "history": history.history,
            }
        )
    )


class RecordReports(UserCallback):
    """Runs in Ray Train's controller: writes what every `ray.train.report`
    call delivered (each worker's metrics, and whether a checkpoint came) to
    `path`, one JSON line per report."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context, metrics, checkpoint) -> None:
        line = {"metrics": metrics, "checkpoint": checkpoint is not None}
        with open(self.path, "a") as file:
            file.write(json.dumps(line) + "\n")
