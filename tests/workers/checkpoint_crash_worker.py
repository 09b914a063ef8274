"""Train with a background `kd.Checkpoint` after every step until killed.

Usage: python checkpoint_crash_worker.py CHECKPOINT_DIR STATE_DIR
The backend comes from KERAS_BACKEND (`kd.DataParallel` on the devices there
are). The model has a 3 MiB kernel (9 MiB with Adam's slots), so that a save
takes a while and a kill often lands in one. For every step, before the
checkpoint callback runs, the SHA-256 of the model's weights at that step goes
to STATE_DIR/fingerprints.jsonl; once the second step of this run has trained
(its first save committed, its second begun), STATE_DIR/started-<pid>.json
says the pid and the step the run resumed from. `fit` runs far longer than
any test: the test kills it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import keras
import numpy as np
import worker_seed

import keras_dist as kd

FEATURES, UNITS = 768, 1024  # a 3 MiB float32 kernel
ROWS, BATCH = 64, 8


def build() -> keras.Model:
    worker_seed.set_random_seed(11)
    inputs = keras.Input((FEATURES,), name="x")
    hidden = keras.layers.Dense(UNITS, activation="relu", name="wide")(inputs)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="crashing")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def fingerprint(model: keras.Model) -> str:
    """The SHA-256 of every weight's bytes, in order."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()


def iterations(model: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class Fingerprints(keras.callbacks.Callback):
    """Before the checkpoint's: the weights' hash at each step."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.handle = open(path, "a")  # noqa: SIM115 (open for the whole fit)

    def on_train_batch_end(self, batch, logs=None):
        line = {"step": iterations(self.model), "sha256": fingerprint(self.model)}
        self.handle.write(json.dumps(line) + "\n")
        self.handle.flush()


class Started(keras.callbacks.Callback):
    """After the checkpoint's: announce this run once its first save is
    committed and its second began."""

    def __init__(self, state_dir: str) -> None:
        super().__init__()
        self.state_dir = state_dir
        self.resumed_from = None
        self.announced = False
        self.batches = 0

    def on_train_begin(self, logs=None):
        self.resumed_from = iterations(self.model)  # restored by now

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        # The second step's save waited for the first one's commit.
        if self.announced or self.batches < 2:
            return
        self.announced = True
        path = os.path.join(self.state_dir, f"started-{os.getpid()}.json")
        with open(path + ".part", "w") as handle:
            json.dump({"pid": os.getpid(), "resumed_from": self.resumed_from}, handle)
        os.replace(path + ".part", path)


def main() -> None:
    directory, state_dir = sys.argv[1], sys.argv[2]
    model = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = x[:, :1] * 0.5
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=10_000,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            Fingerprints(os.path.join(state_dir, "fingerprints.jsonl")),
            kd.Checkpoint(directory, save_freq=1, max_to_keep=3),
            Started(state_dir),
        ],
    )


if __name__ == "__main__":
    main()
