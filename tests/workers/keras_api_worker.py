"""One process of the Keras-API parity jobs (tests/test_keras_api_parity.py).

Usage: python keras_api_worker.py SCENARIO[,SCENARIO...] OUTPUT_JSON
The job comes from the environment: KERAS_DISTRIBUTION_* (tests.multiprocess),
or a cluster that only the backend itself detects.
"""

from __future__ import annotations

import json
import pathlib
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import keras_api_scenarios as scenarios  # noqa: E402


def distribute_dataset() -> dict:
    """`distribute_dataset` called directly, then `fit` under `scope()` on the
    global dataset (where Keras' adapter calls it again)."""
    distribution = kd.DataParallel()
    parts = [
        np.asarray(x)[:, 0].tolist()
        for x, _ in distribution.distribute_dataset(scenarios.tf_dataset())
    ]
    try:
        distribution.distribute_dataset(np.zeros((8, 4)))
        refused = ""
    except ValueError as error:
        refused = str(error)
    model = scenarios.regressor(trainer=True)
    with distribution.scope():
        history = model.fit(scenarios.tf_dataset(), epochs=2, verbose=0).history
    return {
        "processes": kd.num_processes(),
        "parts": parts,
        "refused": refused,
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": history["loss"],
    }


class RecordPlacements(keras.callbacks.Callback):
    """The DTensor placements and local shape of each kernel during `fit`."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, list] = {}

    def on_train_batch_end(self, batch, logs=None):
        if self.held:
            return
        for variable in self.model.weights:
            value = variable.value
            placements = [str(p) for p in getattr(value, "placements", ())]
            local = value.to_local() if placements else value
            layer_path = "/".join(variable.path.split("/")[-2:])  # "hidden/kernel"
            self.held[layer_path] = [placements, list(local.shape)]


def short_layouts() -> dict:
    """A `ModelParallel` whose kernels are mapped with one axis for two."""
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    for key, axes in scenarios.SHORT_LAYOUTS.items():
        layout_map[key] = axes
    record = RecordPlacements()
    model = scenarios.classifier()
    distribution = kd.ModelParallel(layout_map=layout_map)
    weights = scenarios.fit_classifier(
        model, [kd.DistributeCallback(distribution), record]
    )
    return {"weights": [w.tolist() for w in weights], "held": record.held}


def detected_cluster() -> dict:
    """The job JAX's own cluster detection formed, used for one collective."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    ranks = multihost_utils.process_allgather(np.array([kd.process_id()]))
    return {
        "processes": kd.num_processes(),
        "rank": kd.process_id(),
        "devices": kd.list_devices(),
        "gathered_ranks": np.asarray(ranks).reshape(-1).tolist(),
    }


SCENARIOS = {
    "distribute_dataset": distribute_dataset,
    "short_layouts": short_layouts,
    "detected_cluster": detected_cluster,
}


def main() -> None:
    given, output = sys.argv[1], sys.argv[2]
    if "," in given:
        # Several scenarios in turn in one job (one start-up: CI's time), each
        # from a cleared Keras session; the result holds each one's by name.
        result = {}
        for scenario in given.split(","):
            keras.backend.clear_session()
            result[scenario] = SCENARIOS[scenario]()
    else:
        result = SCENARIOS[given]()
    pathlib.Path(output).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
