"""One process of a multi-process JAX test job; the tests start several.

Usage: python jax_worker.py SCENARIO OUTPUT_JSON
The job comes from KERAS_DISTRIBUTION_* and KERAS_DIST_CPU_DEVICES in the
environment. Writes what the test compares to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import pathlib
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras.src.trainers.data_adapters import get_data_adapter  # noqa: E402

from keras_dist.backends import get_adapter  # noqa: E402
from keras_dist.backends.jax.input_adapter import DistributedBatches  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import scenarios  # noqa: E402

SAMPLES = 37
BATCH = 8


def _ids_dataset():
    ids = np.arange(SAMPLES, dtype="float32")[:, None]
    return ids, np.zeros((SAMPLES,), "float32")


def _inputs(kind: str):
    """Each input type `fit` accepts, yielding samples whose feature is its id."""
    x, y = _ids_dataset()
    if kind == "numpy":
        return {"x": x, "y": y, "batch_size": BATCH, "shuffle": True}
    if kind == "tf_data":
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=7)
        return {"x": dataset.batch(BATCH)}
    if kind == "py_dataset":

        class Ids(keras.utils.PyDataset):
            def __len__(self):
                return -(-SAMPLES // BATCH)

            def __getitem__(self, index):
                rows = slice(index * BATCH, (index + 1) * BATCH)
                return x[rows], y[rows]

        return {"x": Ids(), "shuffle": True}
    if kind == "torch_loader":
        import torch

        dataset = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
        generator = torch.Generator().manual_seed(3)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, shuffle=True, generator=generator
        )
        return {"x": loader}
    if kind == "generator":

        def batches():
            for start in range(0, SAMPLES, BATCH):
                yield x[start : start + BATCH], y[start : start + BATCH]

        return {"x": batches()}
    raise ValueError(kind)


INPUT_KINDS = ("numpy", "tf_data", "py_dataset", "torch_loader", "generator")


def seen_ids(kind: str) -> list[list[float]]:
    """Ids that reach this process' devices, per epoch (padding excluded)."""
    distribution = kd.DataParallel()
    epochs = []
    adapter = get_data_adapter(**_inputs(kind))
    # Unseeded processes: process 0's generators must win.
    share = get_adapter().take_process_zero_streams
    for _ in range(2 if kind != "generator" else 1):
        adapter.on_epoch_begin()
        ids: list[float] = []
        batches = DistributedBatches(
            adapter.get_jax_iterator(), distribution, share_random_streams=share
        )
        for batch in batches:
            data, mask = batch if hasattr(batch, "mask") else (batch, None)
            for shard in data[0].addressable_shards:
                rows = np.asarray(shard.data)[:, 0]
                if mask is not None:
                    keep = [
                        np.asarray(m.data)
                        for m in mask.addressable_shards
                        if m.index == (shard.index[0],)
                    ][0]
                    rows = rows[keep > 0]
                ids.extend(float(r) for r in rows)
        adapter.on_epoch_end()
        epochs.append(ids)
    return epochs


def train() -> dict:
    worker_seed.set_random_seed(5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(45, 6)).astype("float32")
    y = rng.integers(0, 3, size=(45,))
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
        metrics=["accuracy", keras.metrics.AUC(name="auc", multi_label=False)],
        weighted_metrics=[keras.metrics.MeanSquaredError(name="mse")],
    )
    distribution = kd.DataParallel()
    history = model.fit(
        x,
        keras.utils.to_categorical(y, 3),
        batch_size=12,
        epochs=3,
        shuffle=True,
        verbose=1,
        callbacks=[
            kd.DistributeCallback(distribution),
            keras.callbacks.CSVLogger(f"{OUTPUT_DIR}/epochs-{kd.process_id()}.csv"),
            keras.callbacks.ModelCheckpoint(
                f"{OUTPUT_DIR}/model-{kd.process_id()}.weights.h5",
                save_weights_only=True,
            ),
        ],
    ).history
    predictions = model.predict(
        x, batch_size=12, verbose=0, callbacks=[kd.DistributeCallback(distribution)]
    )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history,
        "predictions": np.asarray(predictions).tolist(),
        "processes": kd.num_processes(),
        "devices": kd.get_device_count(),
    }


def _own_data_model() -> keras.Model:
    worker_seed.set_random_seed(9)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _own_data_samples() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def own_data() -> dict:
    """auto_shard_dataset=False: process p reads samples p, p + 2, ... only."""
    x, y = _own_data_samples()
    rank = kd.process_id()
    mine = np.arange(SAMPLES)[rank::2]
    distribution = kd.DataParallel(auto_shard_dataset=False)
    model = _own_data_model()
    callback = kd.DistributeCallback(distribution)
    history = model.fit(
        x[mine],
        y[mine],
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    ).history
    predictions = model.predict(
        x[mine],
        batch_size=4,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    expected = model.predict(x[mine], batch_size=len(mine), verbose=0)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history,
        "predictions_match": bool(np.allclose(predictions, expected, atol=1e-5)),
        "rows": len(predictions),
    }


def own_data_reference() -> dict:
    """One process, the global batches the two processes above form together."""
    x, y = _own_data_samples()
    ids = np.arange(SAMPLES)
    shares = [ids[0::2], ids[1::2]]
    order = np.concatenate(
        [
            np.concatenate([s[start : start + 4] for s in shares])
            for start in range(0, 20, 4)
        ]
    )
    model = _own_data_model()
    history = model.fit(
        x[order],
        y[order],
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    ).history
    return {"weights": [w.tolist() for w in model.get_weights()], "history": history}


OUTPUT_DIR = "."


def main() -> None:
    global OUTPUT_DIR
    given, output = sys.argv[1], sys.argv[2]
    OUTPUT_DIR = str(pathlib.Path(output).parent)
    if "," in given:
        # Several scenarios in turn in one job (one start-up: CI's time); the
        # result holds each one's under its name.
        result = {name: run(name) for name in given.split(",")}
    else:
        result = run(given)
    result["process_id"] = kd.process_id()
    with open(output, "w") as handle:
        json.dump(result, handle)


def run(scenario: str) -> dict:
    if scenario == "lose_a_process":
        result = scenarios.lose_a_process()
    elif scenario == "different_data":
        result = scenarios.different_data()
    elif scenario == "own_data":
        result = own_data()
    elif scenario == "own_data_reference":
        result = own_data_reference()
    elif scenario == "train":
        result = train()
    elif scenario == "every_kind":
        # Every input type in one job: one start-up instead of five.
        result = {"ids_by_kind": {kind: seen_ids(kind) for kind in INPUT_KINDS}}
    else:
        result = {"ids": seen_ids(scenario)}
    return result


if __name__ == "__main__":
    main()
