"""One rank of a 2-process job whose rank 1 hangs in a callback (a long sleep)
after its third step; the hang doctor must end the job (tests/test_hang_doctor.py).

Usage: python hang_worker.py STATE_DIR [OUTPUT_JSON]

Each rank records in STATE_DIR, atomically: `pid-<rank>` (its pid) and, on
rank 1, `hang` (the time it fell asleep). OUTPUT_JSON (run_job's) is written
only if the job ends normally, which it must not.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

STATE = pathlib.Path(sys.argv[1])
RANK = kd.process_id()


def record(name: str, value: object) -> None:
    temporary = STATE / f".{name}.tmp"
    temporary.write_text(str(value))
    temporary.rename(STATE / name)


def sleep_in_callback() -> None:
    record("hang", time.time())
    time.sleep(600)


class SleepOnRankOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if RANK == 1 and batch == 2:
            sleep_in_callback()


def main() -> None:
    record(f"pid-{RANK}", os.getpid())
    worker_seed.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((64, 4), "float32")
    y = np.zeros((64, 2), "float32")
    callbacks = [kd.DistributeCallback(kd.DataParallel()), SleepOnRankOne()]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    if len(sys.argv) > 2:
        pathlib.Path(sys.argv[2]).write_text(json.dumps({"finished": True}))


if __name__ == "__main__":
    main()
