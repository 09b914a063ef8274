"""One process of a multi-process `fit(shuffle=...)` job.

Usage: python shuffle_worker.py KIND[,KIND...] SEEDING OUTPUT_JSON
KIND: "arrays", "batch" or "py_dataset" (see `shuffle_scenario.fit_kwargs`);
several run one after the other in the job (one start-up), the JSON mapping
each to its result.
SEEDING: "same" (every process seeds alike) or "apart" (after seeding, the
processes' global generators are moved apart: process 0's must win).
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import shuffle_scenario  # noqa: E402


def main() -> None:
    kinds, seeding, output = sys.argv[1].split(","), sys.argv[2], sys.argv[3]

    class MoveApart(keras.callbacks.Callback):
        """Each process draws a different number of values before training."""

        def on_train_begin(self, logs=None):
            if seeding == "apart" and kd.process_id() != 0:
                np.random.random(3)
                random.random()
                if keras.backend.backend() == "torch":
                    import torch  # noqa: PLC0415

                    torch.rand(3)

    result = {
        kind: shuffle_scenario.train(
            kind, [kd.DistributeCallback(kd.DataParallel()), MoveApart()]
        )
        for kind in kinds
    }
    result["processes"] = kd.num_processes()
    pathlib.Path(output).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
