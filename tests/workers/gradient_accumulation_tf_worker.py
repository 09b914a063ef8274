"""One rank of a TensorFlow job (`MultiWorkerMirroredStrategy`) for
tests/test_gradient_accumulation.py: Adam with `gradient_accumulation_steps`
under `kd.DataParallel`, trained as gradient_accumulation_worker.py trains
(the test trains its one-device references itself).

Usage: python gradient_accumulation_tf_worker.py OUTPUT_JSON
"""

from __future__ import annotations

import json
import sys

import gradient_accumulation_worker as worker
import numpy as np

import keras_dist as kd


def main() -> None:
    kd.initialize()
    distributed = worker.train(
        "adam", accumulate=True, callbacks=(kd.DistributeCallback(kd.DataParallel()),)
    )
    result = {
        "processes": kd.num_processes(),
        "distributed": worker.weights(distributed),
        "iterations": int(np.asarray(distributed.optimizer.iterations)),
    }
    with open(sys.argv[-1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
