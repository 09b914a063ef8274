"""One training process as a cluster engine starts it (an `srun` task, a
Kubernetes pod): `kd.initialize()` without arguments finds the job.

Usage: python cluster_worker.py OUTPUT_DIR
Writes OUTPUT_DIR/result-<rank>.json: the job it joined, the cluster
environment keras_dist detected, and the weights after training.
"""

from __future__ import annotations

import json
import pathlib
import sys

import keras_dist as kd
from keras_dist import cluster
from keras_dist.runtime import api as runtime

kd.initialize()

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import cluster_scenario  # noqa: E402

detected = cluster.detect_cluster()
weights = cluster_scenario.train(kd.DataParallel())
result = {
    "processes": kd.num_processes(),
    "rank": kd.process_id(),
    "detected": None if detected is None else type(detected).__name__,
    "coordinator": runtime.resolve_cluster()[0],
    "weights": weights,
}
output = pathlib.Path(sys.argv[1]) / f"result-{kd.process_id()}.json"
output.write_text(json.dumps(result))
