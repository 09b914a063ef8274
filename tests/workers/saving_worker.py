"""One process of a multi-process job that saves, backs up and logs to files.

Usage: python saving_worker.py SCENARIO [MODE] DIRECTORY OUTPUT_JSON
The backend comes from KERAS_BACKEND, the job from KERAS_DISTRIBUTION_*.
Every process calls what users call on every process; the test checks that one
complete set of files results.

Scenarios:
- `backup MODE DIRECTORY`: fit 4 epochs with `BackupAndRestore(DIRECTORY)`;
  MODE `interrupted` raises on every process when epoch 2 begins, `resumed`
  (a new job) goes on from the backup, `uninterrupted` trains without a backup
  and also trains plain Keras on one device from process 0's initial weights.
  MODE may name several modes (`uninterrupted,interrupted`), run in turn.
- `save DIRECTORY`: fit with TensorBoard and CSVLogger, then `model.save`,
  `save_weights` and `keras.saving.save_model` after `fit`, and load them.
"""

from __future__ import annotations

import json
import os
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

EPOCHS = 4


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")) + 0.1


def model(seed: int) -> keras.Model:
    worker_seed.set_random_seed(seed)
    net = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    net.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    return net


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted at epoch 2")


def files_under(directory: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
    )


def weights_of(net: keras.Model) -> list:
    return [w.tolist() for w in net.get_weights()]


def backup(mode: str, directory: str) -> dict:
    x, y = data()
    # Different initial weights on purpose: process 0's win everywhere.
    net = model(100 + kd.process_id())
    callbacks = [kd.DistributeCallback(kd.DataParallel())]
    backup_dir = os.path.join(directory, "backup")
    if mode != "uninterrupted":
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir))
    if mode == "interrupted":
        callbacks.append(Interrupt())
    result: dict = {}
    try:
        history = net.fit(
            x,
            y,
            batch_size=8,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        ).history
        result["epochs_run"] = len(history["loss"])
    except RuntimeError as error:
        result["error"] = str(error)
    result["weights"] = weights_of(net)
    if mode == "uninterrupted":
        plain = model(100)
        plain.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
        result["plain_weights"] = weights_of(plain)
    return result


def save(directory: str) -> dict:
    x, y = data()
    net = model(100 + kd.process_id())
    logs = os.path.join(directory, "logs")
    net.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x[:16], y[:16]),
        callbacks=[
            keras.callbacks.TensorBoard(logs),
            kd.DistributeCallback(kd.DataParallel()),
            keras.callbacks.CSVLogger(os.path.join(directory, "epochs.csv")),
        ],
    )
    trained = net.get_weights()
    # What users write after `fit`, on every process.
    net.save(os.path.join(directory, "m.keras"))
    net.save_weights(os.path.join(directory, "w.weights.h5"))
    keras.saving.save_model(net, os.path.join(directory, "saved.keras"))
    if kd.process_id() == 0 and keras.backend.backend() != "tensorflow":
        # What users guarding their saves write: process 0 does not wait for
        # the others (on TensorFlow they meet at a barrier).
        net.save_weights(os.path.join(directory, "only0.weights.h5"))
    loaded = [
        keras.saving.load_model(os.path.join(directory, name)).get_weights()
        for name in ("m.keras", "saved.keras")
    ]
    fresh = model(7)
    fresh.load_weights(os.path.join(directory, "w.weights.h5"))
    loaded.append(fresh.get_weights())
    error = max(
        float(np.max(np.abs(a - b)))
        for weights in loaded
        for a, b in zip(weights, trained, strict=True)
    )
    return {"loaded_error": error, "weights": [w.tolist() for w in trained]}


def main() -> None:
    scenario, *args, output = sys.argv[1:]
    if scenario == "backup" and "," in args[0]:
        # Several modes in turn in one job (one start-up: CI's time), each from
        # a cleared Keras session; the result holds each one's by name.
        modes, directory = args[0].split(","), args[1]
        result = {}
        for mode in modes:
            keras.backend.clear_session()
            result[mode] = backup(mode, directory)
    elif scenario == "backup":
        result = backup(*args)
    elif scenario == "save":
        result = save(*args)
    else:
        raise ValueError(f"Unknown scenario {scenario!r}")
    # The saves above returned once process 0's files were complete.
    result["files"] = files_under(args[-1])
    result["process_id"] = kd.process_id()
    with open(output, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
