"""One rank of a 2-process job under `keras-dist launch` that trains until a
fault ends it (tests/test_fault_lifecycle.py).

Usage: python fault_lifecycle_worker.py STATE_DIR MODE [RAISING_RANKS]

MODE `train` trains (with a ModelCheckpoint) until something outside stops the
job; MODE `raise` has each of RAISING_RANKS (`1`, or `0,1`) raise a ValueError
from a callback in the second epoch. Each rank records in STATE_DIR, each file
written atomically: `pid-<rank>` and `pid-<rank>-grandchild` (a sleeping
process it started), `ready-<rank>` once it trains, `fault` (the time it
raised). It also leaves a directory in the temporary directory, as Keras does,
for the job to remove.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

STATE = pathlib.Path(sys.argv[1])
MODE = sys.argv[2]
RAISING_RANKS = (
    {int(rank) for rank in sys.argv[3].split(",")} if len(sys.argv) > 3 else set()
)
RANK = kd.process_id()


def record(name: str, value: object) -> None:
    # A name of its own: two ranks may record the same value at once.
    temporary = STATE / f".{name}.{RANK}.tmp"
    temporary.write_text(str(value))
    temporary.rename(STATE / name)


class Fault(keras.callbacks.Callback):
    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == 2:
            record(f"ready-{RANK}", time.time())
        if MODE == "raise" and RANK in RAISING_RANKS and self.epoch == 1:
            record("fault", time.time())
            raise ValueError(f"rank {RANK} raised in a callback at batch {batch}")
        # Fewer steps per second: two ranks share the test machine's cores.
        time.sleep(0.02)


def main() -> None:
    grandchild = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"]
    )
    record(f"pid-{RANK}-grandchild", grandchild.pid)
    record(f"pid-{RANK}", os.getpid())
    tempfile.mkdtemp()  # as Keras' saving does; the job must remove it
    worker_seed.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    # Made here: Keras' ModelCheckpoint creates it on every rank, and two
    # ranks racing to create it is not what these tests are about.
    (STATE / "checkpoints").mkdir(exist_ok=True)
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(STATE / "checkpoints" / "model.weights.h5"),
        save_weights_only=True,
        save_freq=4,
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=3 if MODE == "raise" else 100_000,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel()), checkpoint, Fault()],
    )


if __name__ == "__main__":
    main()
