"""One rank of a job that trains under `kd.Checkpoint` and may be cut short.

Usage: python checkpoint_resume_worker.py CHECKPOINT_DIR STATE_DIR [OUTPUT]
Started by `keras-dist launch` (no OUTPUT) or by `tests.multiprocess.run_job`.
Environment:
- FAULTS: `signal@step@rank,...` (e.g. `KILL@9@1,TERM@14@0`): the n-th fault
  happens in the n-th attempt of the job (`KERAS_DIST_RESTART_COUNT`), when
  that rank has finished that global step: the rank sends itself the signal.
- DROPOUT: "0" leaves Dropout out (runs on another world size differ in it).
- STEP_SECONDS: a pause after every batch (a test signals the job mid-fit).
- PAUSE_AT: `processes@step,...` (e.g. `2@5,1@11`): in a job of that many
  processes, process 0 writes TIMES_DIR/paused-<processes> after that global
  step and waits there (at most 120 s, or until a preemption signal) for the
  test to change the job around it.
- TIMES_DIR: process 0 writes there when each attempt trained its first step
  (`first-step-<attempt>.time`), and a faulting rank when it faults
  (`fault-<attempt>.time`).
- INPUT: "py_dataset" feeds the same batches as a `PyDataset` (shuffled, its
  batches' order, with SHUFFLE) instead of arrays; "arrays,py_dataset" runs one
  fit for each in turn, each under CHECKPOINT_DIR/<kind>, and the result holds
  each one's under its name (one job for both: CI's time).
Every epoch's logs go to STATE_DIR/epochs.jsonl (process 0, one line per
epoch, the last attempt's line wins); each rank writes its final weights and
logs to STATE_DIR/result-<rank>.json (or OUTPUT).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import worker_seed

import keras_dist as kd

ROWS, BATCH, EPOCHS = 45, 8, 3  # 6 batches an epoch, the last one of 5 rows


def build(dropout: bool = True) -> keras.Model:
    worker_seed.set_random_seed(1)
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    if dropout:
        hidden = keras.layers.Dropout(0.3, name="dropout")(hidden)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="resumable")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")


class Batches(keras.utils.PyDataset):
    """`data()` in batches of BATCH rows."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = data()

    def __len__(self) -> int:
        return -(-ROWS // BATCH)

    def __getitem__(self, index: int):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def fit_inputs(kind: str | None = None) -> dict:
    """`fit`'s data arguments for `kind` ("arrays" or "py_dataset"; by default
    the INPUT environment variable's)."""
    if (kind or os.environ.get("INPUT", "arrays")) == "py_dataset":
        return {"x": Batches()}
    x, y = data()
    return {"x": x, "y": y, "batch_size": BATCH}


def fit_in_this_process(directory, kind: str = "arrays", callbacks=()):
    """The worker's fit (no Dropout) in the caller's process (one process, all
    its devices), never interrupted; the model and its History."""
    model = build(dropout=False)
    keras.utils.set_random_seed(7)
    history = model.fit(
        **fit_inputs(kind),
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory, save_freq=2, max_to_keep=None),
            *callbacks,
        ],
    )
    return model, history


class Fault(keras.callbacks.Callback):
    """This attempt's fault: the rank signals itself after a global step."""

    def __init__(self, checkpoint: kd.Checkpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        faults = [f for f in os.environ.get("FAULTS", "").split(",") if f]
        attempt = int(os.environ.get("KERAS_DIST_RESTART_COUNT", "0"))
        self.fault = faults[attempt].split("@") if attempt < len(faults) else None

    def on_train_batch_end(self, batch, logs=None):
        # A slower job, for a test to signal it mid-fit.
        time.sleep(float(os.environ.get("STEP_SECONDS", "0")))
        attempt = os.environ.get("KERAS_DIST_RESTART_COUNT", "0")
        times = os.environ.get("TIMES_DIR")
        if times and kd.process_id() == 0:
            # When each attempt trained its first step (the time back to
            # training after a fault).
            first = os.path.join(times, f"first-step-{attempt}.time")
            if not os.path.exists(first):
                with open(first, "w") as handle:
                    handle.write(repr(time.time()))
        self._pause(times)
        if self.fault is None:
            return
        name, step, rank = self.fault
        if self.checkpoint._global_step == int(step) and kd.process_id() == int(rank):
            if times:
                with open(os.path.join(times, f"fault-{attempt}.time"), "w") as handle:
                    handle.write(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))

    def _pause(self, times: str | None) -> None:
        pauses = dict(
            pause.split("@")
            for pause in os.environ.get("PAUSE_AT", "").split(",")
            if pause
        )
        step = pauses.get(str(kd.num_processes()))
        marker = os.path.join(times or "", f"paused-{kd.num_processes()}")
        if (
            step is None
            or kd.process_id() != 0
            or self.checkpoint._global_step != int(step)
            or os.path.exists(marker)
        ):
            return
        with open(marker, "w") as handle:
            handle.write(step)
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline and self.checkpoint._preemption.signal is None
        ):
            time.sleep(0.05)


class EpochLog(keras.callbacks.Callback):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        if kd.process_id() == 0:
            line = {"epoch": epoch, **{k: float(v) for k, v in (logs or {}).items()}}
            with open(self.path, "a") as handle:
                handle.write(json.dumps(line) + "\n")


def _fit(directory: str, state: str, kind: str) -> dict:
    model = build(dropout=os.environ.get("DROPOUT", "1") == "1")
    checkpoint = kd.Checkpoint(
        directory,
        save_freq=2,
        max_to_keep=None,
        save_on_background=os.environ.get("BACKGROUND", "1") == "1",
    )
    worker_seed.set_random_seed(7)
    history = model.fit(
        **fit_inputs(kind),
        epochs=EPOCHS,
        shuffle=os.environ.get("SHUFFLE", "1") == "1",
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            checkpoint,
            Fault(checkpoint),
            EpochLog(os.path.join(state, "epochs.jsonl")),
        ],
    )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history.history,
    }


def main() -> None:
    directory, state = sys.argv[1], sys.argv[2]
    kd.initialize()
    kinds = os.environ.get("INPUT", "arrays").split(",")
    if len(kinds) == 1:
        result = _fit(directory, state, kinds[0])
    else:
        result = {
            kind: _fit(os.path.join(directory, kind), state, kind) for kind in kinds
        }
    output = (
        sys.argv[3]
        if len(sys.argv) > 3
        else os.path.join(state, f"result-{kd.process_id()}.json")
    )
    with open(output, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
