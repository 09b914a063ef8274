"""One process of a job whose `kd.Checkpoint` directories differ, then agree.

Usage: python checkpoint_directory_worker.py BASE_DIR OUTPUT_JSON

First each process fits with `kd.Checkpoint(BASE_DIR/own-<rank>)`, as a
default under each rank's own TMPDIR would give it: `fit` must refuse at once.
Then, on the same model (left as it was: its weights, Keras' global
distribution; plain Keras predicts with it), rank 0 passes
`BASE_DIR/shared` and the others `BASE_DIR/link`, a link to it that the test
made (one real path): `fit` trains and saves. Writes the
refusal's type and message, the seconds it took, and the steps saved.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import keras
import numpy as np
import worker_seed


def build() -> keras.Model:
    worker_seed.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def fit(model: keras.Model, directory: Path) -> None:
    x = np.ones((16, 3), "float32")
    model.fit(
        x,
        x[:, :1],
        batch_size=8,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory),
        ],
    )


def main(base: Path, output: Path) -> None:
    kd.initialize()
    rank = kd.process_id()
    model = build()
    before = model.get_weights()
    started = time.monotonic()
    try:
        fit(model, base / f"own-{rank}")
        refusal = None
    except ValueError as error:
        refusal = {"type": type(error).__name__, "message": str(error)}
    seconds = time.monotonic() - started
    # The refused call left the model and Keras as they were: the same
    # model, plain Keras and the corrected call work.
    untouched = kd.distribution() is None and all(
        np.array_equal(a, b) for a, b in zip(model.get_weights(), before, strict=True)
    )
    model.predict(np.ones((4, 3), "float32"), verbose=0)
    fit(model, base / ("shared" if rank == 0 else "link"))
    output.write_text(
        json.dumps(
            {
                "refusal": refusal,
                "untouched": untouched,
                "seconds": seconds,
                "own_made": (base / f"own-{rank}").exists(),
                "steps": sorted(p.name for p in (base / "shared").glob("step-*")),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
