"""One process of a multi-worker TensorFlow test job; the tests start several.

Usage: python tf_worker.py SCENARIO OUTPUT_JSON
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

import keras  # noqa: E402
import numpy as np  # noqa: E402

SAMPLES, BATCH = 45, 12


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, size=(SAMPLES,))
    return x, keras.utils.to_categorical(y, 3)


def _model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="categorical_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
        weighted_metrics=[keras.metrics.MeanSquaredError(name="mse")],
    )
    return model


def train() -> dict:
    # Different seeds on purpose: process 0's weights must win everywhere.
    keras.utils.set_random_seed(100 + kd.process_id())
    x, y = _data()
    weights = np.linspace(0.5, 1.5, SAMPLES).astype("float32")
    model = _model()  # built outside the scope: mirrored when fit starts
    distribution = kd.DataParallel()
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=2,
        validation_data=(x[:20], y[:20]),
        callbacks=[kd.DistributeCallback(distribution)],
    ).history
    predictions = model.predict(
        x, batch_size=BATCH, verbose=0, callbacks=[kd.DistributeCallback(distribution)]
    )
    evaluation = model.evaluate(
        x,
        y,
        batch_size=7,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history,
        "evaluation": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        "processes": kd.num_processes(),
        "devices": kd.list_devices(),
    }


def seen_ids() -> list[list[float]]:
    """The sample ids this process' replicas got, per epoch, shuffled arrays."""
    from keras.src.trainers.data_adapters import get_data_adapter

    from keras_dist.backends import get_adapter
    from keras_dist.backends import tf_input_adapter as inputs

    adapter = get_adapter()
    distribution = kd.DataParallel()
    strategy = adapter.strategy(distribution)
    ids = np.arange(37, dtype="float32")[:, None]
    data = get_data_adapter(ids, np.zeros((37,)), batch_size=8, shuffle=True)
    stream = adapter.shuffle_stream(strategy)
    epochs = []
    for _ in range(2):
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
        epochs.append(seen)
    return epochs


def keras_20585() -> dict:
    """Keras 3's own fit under MultiWorkerMirroredStrategy, without keras_dist,
    then with keras_dist's workarounds (keras-team/keras#20585)."""
    from keras_dist import _rendezvous
    from keras_dist.cluster import environment_int, environment_value

    rank = environment_int("KERAS_DISTRIBUTION_PROCESS_ID")
    count = environment_int("KERAS_DISTRIBUTION_NUM_PROCESSES")
    coordinator = environment_value("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    addresses = _rendezvous.exchange_addresses(
        coordinator, count, rank, timeout_seconds=60
    )
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
    )
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = _data()
    with strategy.scope():
        model = _model()
    errors = {}

    def fit() -> str | None:
        try:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        except Exception as error:  # what Keras raises is what we record
            return f"{type(error).__name__}: {error}"
        return None

    errors["keras"] = fit()
    from keras.src.backend.tensorflow import trainer as tf_trainer

    from keras_dist.backends import tf_keras_internals

    # Only the symbolic-build fix: the next bug shows.
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = (
        tf_keras_internals._maybe_symbolic_build
    )
    errors["build_fixed"] = fit()
    tf_keras_internals.install_multi_worker_fixes()
    errors["both_fixed"] = fit()
    return {"errors": errors, "weights": [w.tolist() for w in model.get_weights()]}


def different_data() -> dict:
    """Each process reads different data: splitting it would lose samples."""
    x = np.full((16, 6), float(kd.process_id()), "float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(
            x,
            x[:, :1],
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def lose_a_process() -> dict:
    """Process 1 dies in the middle of the second epoch."""
    import time

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if kd.process_id() == 1 and self.epoch == 1 and batch == 2:
                os._exit(17)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    x = np.random.default_rng(0).normal(size=(200, 6)).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    started = time.monotonic()
    try:
        model.fit(
            x,
            x[:, :1],
            batch_size=8,
            epochs=50,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel()), Die()],
        )
    except Exception as error:  # the survivor must get here, not hang
        print(f"survivor error after {time.monotonic() - started:.1f}s: {error}")
        raise
    return {}


def main() -> None:
    output = pathlib.Path(sys.argv[2])
    if SCENARIO == "train":
        result = train()
    elif SCENARIO == "ids":
        result = {"ids": seen_ids()}
    elif SCENARIO == "keras_20585":
        result = keras_20585()
    elif SCENARIO == "different_data":
        result = different_data()
    elif SCENARIO == "lose_a_process":
        result = lose_a_process()
    else:
        raise ValueError(SCENARIO)
    result["process_id"] = kd.process_id()
    output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
