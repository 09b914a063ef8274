"""One process of a JAX job of one device a process (one GPU a process) that
saves with `kd.Checkpoint` at every epoch's end and resumes.

Usage: python checkpoint_one_device_worker.py CHECKPOINT_DIR OUTPUT_JSON

Fits `model(1)` 2 epochs under DataParallel with `kd.Checkpoint(save_freq=
"epoch")`: the first save is made at the second epoch's start, once Keras
reset the metrics (laid out across the processes). Then a different
`model(7)` fits 3 epochs from CHECKPOINT_DIR: it resumes after epoch 2 and
trains the third. Writes what the second epoch's start saw and the final
weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import keras
import numpy as np
import worker_seed

BATCH = 8


def model(seed: int) -> keras.Model:
    worker_seed.set_random_seed(seed)
    net = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    net.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return net


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    return x, rng.integers(0, 3, size=(40,))


def malformed(net: keras.Model) -> list[str]:
    """Variables whose value has a local buffer spanning several devices: a
    global array JAX, Orbax and `np.asarray` cannot take apart."""
    return [
        variable.path
        for variable in [*net.variables, *net.optimizer.variables]
        if any(len(b.sharding.device_set) != 1 for b in variable.value._arrays)
    ]


class AtSecondEpochStart(keras.callbacks.Callback):
    """What the model looks like at the second epoch's start (after Keras
    reset the metrics and `kd.Checkpoint` saved)."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != 1:
            return
        self.seen = {
            "malformed": malformed(self.model),
            "weights": [w.tolist() for w in self.model.get_weights()],
            "metrics": {
                name: float(np.asarray(value))
                for name, value in self.model.get_metrics_result().items()
            },
        }


def main(directory: Path, output: Path) -> None:
    kd.initialize()
    x, y = data()
    probe = AtSecondEpochStart()
    first = model(1)
    history = first.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory, save_freq="epoch"),
            probe,
        ],
    )
    resumed = model(7)
    resumed.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory, save_freq="epoch"),
        ],
    )
    output.write_text(
        json.dumps(
            {
                **probe.seen,
                "history": history.history,
                "steps": sorted(int(p.name[5:]) for p in directory.glob("step-*")),
                "malformed_at_end": malformed(resumed),
                "iterations": int(np.asarray(resumed.optimizer.iterations.value)),
                "final": [w.tolist() for w in resumed.get_weights()],
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
