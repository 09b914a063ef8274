"""One process of a 2-worker TensorFlow checkpoint job; the tests start two.

Usage: python checkpoint_tf_worker.py DIRECTORY BACKGROUND(0|1) OUTPUT_JSON

Trains `model()` a few steps under `kd.DataParallel()` (one replica per
process, `MultiWorkerMirroredStrategy`), saves it with the TensorFlow engine
into DIRECTORY, and writes what the test compares a restore with: the
predictions, the optimizer's step, the saved values.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

SAMPLES = 45
BATCH = 12


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    return x, rng.integers(0, 3, size=(SAMPLES,))


def model():
    """Dense, BatchNormalization, Dropout (a seed generator), Adam, a metric."""
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    directory, background, output = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    import keras_dist as kd  # noqa: PLC0415

    kd.initialize()  # before any TensorFlow op: the multi-worker runtime
    from keras_dist.backends.tensorflow import checkpoint as engine  # noqa: PLC0415
    from keras_dist.checkpoint.keys import saveable_variables  # noqa: PLC0415

    trained = model()
    x, y = data()
    first = f"{directory}-first"
    if kd.process_id() == 0:
        os.makedirs(first, exist_ok=True)
        os.makedirs(directory, exist_ok=True)
    pending = None
    for target in (first, directory):
        trained.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
        # The second save waits for the first (one in flight) and reuses its
        # checkpoint object: TensorFlow's traced copy of the variables.
        state = saveable_variables(trained)
        pending = engine.save(target, state, background=background)
    pending.wait(120)
    # Read after the save: a SyncOnRead metric state is read with an
    # all-reduce, which every worker joins.
    values = {key: np.asarray(v.numpy()).tolist() for key, v in state.items()}
    key = "optimizer/vars/0"  # the step counter
    assert state[key] is trained.optimizer.iterations, key
    iterations = {"shape": [], "dtype": str(state[key].dtype)}
    result = {
        "rank": kd.process_id(),
        "kernel_type": type(state["layers/dense/vars/0"].value).__name__,
        "predictions": np.asarray(trained(x, training=False)).tolist(),
        "iterations": int(trained.optimizer.iterations.numpy()),
        "values": values,
        "entries": {
            key: {"shape": [int(d) for d in v.shape], "dtype": str(v.dtype)}
            for key, v in state.items()
        },
        "files": sorted(os.listdir(directory)) if kd.process_id() == 0 else [],
        "first_iterations": (
            int(engine.read_arrays(first, {"optimizer/vars/0": iterations})[key])
            if kd.process_id() == 0
            else None
        ),
    }
    with open(output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
