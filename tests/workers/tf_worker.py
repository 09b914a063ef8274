"""One process of a multi-worker TensorFlow test job; the tests start several.

Usage: python tf_worker.py SCENARIO[,SCENARIO...] OUTPUT_JSON
The job comes from KERAS_DISTRIBUTION_* in the environment (or TF_CONFIG).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

SCENARIO = sys.argv[1]

import keras_dist as kd  # noqa: E402

if SCENARIO != "keras_20585":
    # Before any TensorFlow op: the multi-worker runtime starts here.
    kd.initialize()

import numpy as np  # noqa: E402

BATCH = 12

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import scenarios  # noqa: E402


def keras_reshuffles() -> bool:
    """Whether plain Keras on one device draws another order of shuffled
    arrays in its second epoch: it iterates the dataset its epoch iterator
    built once (Keras 3.15: yes; Keras 3.16 fixes the order when it builds the
    dataset, from the adapter's epoch counter: no)."""
    from keras.src.trainers.data_adapters import get_data_adapter

    ids = np.arange(37, dtype="float32")[:, None]
    data = get_data_adapter(ids, np.zeros((37,)), batch_size=8, shuffle=True)
    dataset = data.get_tf_dataset()
    orders = []
    for _ in range(2):
        data.on_epoch_begin()
        orders.append([float(v) for x, _ in dataset for v in x.numpy()[:, 0]])
        data.on_epoch_end()
    return orders[0] != orders[1]


def seen_ids() -> list[list[float]]:
    """The sample ids this process' replicas got, per epoch, shuffled arrays."""
    from keras.src.trainers.data_adapters import get_data_adapter

    from keras_dist.backends import get_adapter
    from keras_dist.backends.tensorflow import input_adapter as inputs

    adapter = get_adapter()
    distribution = kd.DataParallel()
    strategy = adapter.strategy(distribution)
    ids = np.arange(37, dtype="float32")[:, None]
    data = get_data_adapter(ids, np.zeros((37,)), batch_size=8, shuffle=True)
    stream = adapter.shuffle_stream(strategy)
    epochs = []
    for _ in range(2):
        data.on_epoch_begin()
        seen: list[float] = []
        batches = inputs.distributed_batches(
            strategy,
            adapter.global_batches(data, stream),
            num_workers=kd.num_processes(),
            worker_index=kd.process_id(),
        )
        for element in batches:
            for piece in strategy.experimental_local_results(element):
                rows = piece[inputs.DATA][0].numpy()[:, 0]
                seen.extend(float(r) for r in rows[piece[inputs.MASK].numpy() > 0])
        data.on_epoch_end()
        epochs.append(seen)
    return epochs


def keras_20585() -> dict:
    """Keras 3's own fit under MultiWorkerMirroredStrategy, without keras_dist,
    then with keras_dist's workarounds (keras-team/keras#20585)."""
    from keras_dist.cluster import rendezvous
    from keras_dist.cluster.environments import environment_int, environment_value

    rank = environment_int("KERAS_DISTRIBUTION_PROCESS_ID")
    count = environment_int("KERAS_DISTRIBUTION_NUM_PROCESSES")
    coordinator = environment_value("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    addresses = rendezvous.exchange_addresses(
        coordinator, count, rank, timeout_seconds=60
    )
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
    )
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = scenarios.classification_data()
    with strategy.scope():
        model = scenarios.classification_model()
    errors = {}

    def fit() -> str | None:
        try:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        except Exception as error:  # what Keras raises is what we record
            return f"{type(error).__name__}: {error}"
        return None

    errors["keras"] = fit()
    from keras_dist.backends.tensorflow import keras_internals as tf_keras_internals

    # Only the symbolic-build fix: the next bug shows.
    tf_keras_internals.TensorFlowTrainer._maybe_symbolic_build = (
        tf_keras_internals.maybe_symbolic_build
    )
    errors["build_fixed"] = fit()
    tf_keras_internals.install_multi_worker_fixes()
    errors["both_fixed"] = fit()
    return {"errors": errors, "weights": [w.tolist() for w in model.get_weights()]}


def main() -> None:
    output = pathlib.Path(sys.argv[2])
    if "," in SCENARIO:
        # Several scenarios in turn in one job (one start-up: CI's time); the
        # result holds each one's under its name.
        result = {name: run(name) for name in SCENARIO.split(",")}
    else:
        result = run(SCENARIO)
    result["process_id"] = kd.process_id()
    output.write_text(json.dumps(result))


def run(scenario: str) -> dict:
    if scenario == "train":
        # Weighted samples; built outside the scope: mirrored when fit starts;
        # BatchNormalization over both workers' rows.
        result = scenarios.train(
            batch_norm=True, sample_weights=True, shuffle=False, verbose=2
        )
    elif scenario == "ids":
        result = {"ids": seen_ids(), "keras_reshuffles": keras_reshuffles()}
    elif scenario == "keras_20585":
        result = keras_20585()
    elif scenario == "different_data":
        result = scenarios.different_data()
    elif scenario == "lose_a_process":
        result = scenarios.lose_a_process()
    else:
        raise ValueError(scenario)
    return result


if __name__ == "__main__":
    main()
