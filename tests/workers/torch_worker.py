"""One process of a multi-process PyTorch (gloo) test job.

Usage: python torch_worker.py SCENARIO OUTPUT_JSON
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
from keras_dist.backends.torch.input_adapter import RankBatches  # noqa: E402
from keras_dist.backends.torch.keras_internals import keras_batches  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import scenarios  # noqa: E402
from jax_worker import (  # noqa: E402
    INPUT_KINDS,
    _inputs,
    own_data,
    own_data_reference,
)


def seen_ids(kind: str) -> list[list[float]]:
    epochs = []
    adapter = get_data_adapter(**_inputs(kind))
    # Unseeded processes: process 0's generators must win.
    share = get_adapter().take_process_zero_streams
    for _ in range(2 if kind != "generator" else 1):
        adapter.on_epoch_begin()
        ids: list[float] = []
        # The global batches as `fit` reads them on torch: Keras' DataLoader
        # (torch tensors, each process keeping its rows in torch; the uneven
        # last batch of 37 samples is padded through NumPy).
        batches = RankBatches(
            keras_batches(adapter),
            world_size=kd.num_processes(),
            rank=kd.process_id(),
            device="cpu",
            share_random_streams=share,
        )
        for batch in batches:
            rows = batch.data[0][:, 0].numpy()[batch.mask.numpy() > 0]
            ids.extend(float(r) for r in rows)
        adapter.on_epoch_end()
        epochs.append(ids)
    return epochs


LOADER_SAMPLES = 37  # batches of 12: 12, 12, 12, 1 (process 1 has no row of the last)


def _loader_options(kind: str) -> dict:
    if kind == "shuffled":  # two worker processes per rank
        return {"shuffle": True, "num_workers": 2}
    if kind == "drop_last":
        return {"shuffle": False, "drop_last": True}
    if kind == "iterable":
        return {}
    raise ValueError(kind)


def loader_training(kind: str, record: pathlib.Path) -> dict:
    """`fit` on a torch DataLoader whose dataset writes each batch it loads.

    Each line of `record` is `[epoch, indices]` for one batch this process (or
    one of its loader workers) loaded while training.
    """
    import torch

    rng = np.random.default_rng(2)
    x = rng.normal(size=(LOADER_SAMPLES, 6)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 3, size=(LOADER_SAMPLES,)), 3)

    class Recording:
        epoch = None  # set by `RecordEpochs`; None: not training

        def write(self, indices: list[int]) -> None:
            if self.epoch is not None:
                with open(record, "a") as handle:
                    handle.write(json.dumps([self.epoch, indices]) + "\n")

    class MapSamples(Recording, torch.utils.data.Dataset):
        def __len__(self):
            return LOADER_SAMPLES

        def __getitem__(self, index):
            return torch.from_numpy(x[index]), torch.from_numpy(y[index])

        def __getitems__(self, indices):
            self.write([int(i) for i in indices])
            return [self[i] for i in indices]

    class StreamedSamples(Recording, torch.utils.data.IterableDataset):
        def __iter__(self):
            self.write(list(range(LOADER_SAMPLES)))
            for index in range(LOADER_SAMPLES):
                yield torch.from_numpy(x[index]), torch.from_numpy(y[index])

    class RecordEpochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            dataset.epoch = epoch

        def on_train_end(self, logs=None):
            dataset.epoch = None

    dataset = StreamedSamples() if kind == "iterable" else MapSamples()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=12, **_loader_options(kind)
    )
    # Different seeds on purpose: process 0's weights and shuffle must win.
    worker_seed.set_random_seed(100 + kd.process_id())
    model = scenarios.classification_model(batch_norm=False)
    distribution = kd.DataParallel()
    history = model.fit(
        loader,
        epochs=3,
        verbose=0,
        validation_data=(x[:20], y[:20]),
        callbacks=[kd.DistributeCallback(distribution), RecordEpochs()],
    ).history
    in_order = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    predictions = model.predict(
        torch.utils.data.DataLoader(in_order, batch_size=8),
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    evaluation = model.evaluate(
        torch.utils.data.DataLoader(in_order, batch_size=7),
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    loads = []
    if record.exists():
        loads = [json.loads(line) for line in record.read_text().splitlines()]
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history,
        "evaluation": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        "expected_predictions": keras.ops.convert_to_numpy(model(x)).tolist(),
        "loads": loads,
    }


def loader_mismatch() -> dict:
    """Process 1's DataLoader has one sample fewer than process 0's."""
    import torch

    samples = 37 - kd.process_id()
    dataset = torch.utils.data.TensorDataset(
        torch.zeros(samples, 6), torch.zeros(samples, 3)
    )
    model = scenarios.classification_model(batch_norm=False)
    try:
        model.fit(
            torch.utils.data.DataLoader(dataset, batch_size=12, shuffle=True),
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def unused_weight(distributed: bool = True) -> dict:
    """A head the model never calls: its weights get no gradient. Under
    keras_dist (2 processes, DDP) or plain Keras (the reference, 1 process);
    AdamW's weight decay would move the head if it got a zero gradient."""

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.used = keras.layers.Dense(1, name="used")
            self.unused = keras.layers.Dense(1, name="unused")

        def call(self, x):
            return self.used(x)

    keras.utils.set_random_seed(1)
    model = TwoHeads()
    model(np.zeros((1, 6), "float32"))
    model.unused(np.zeros((1, 6), "float32"))
    initial_head = [np.asarray(w).tolist() for w in model.unused.get_weights()]
    model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1), loss="mse")
    x, _ = scenarios.classification_data()
    callbacks = [kd.DistributeCallback(kd.DataParallel())] if distributed else []
    history = model.fit(
        x,
        x[:, :1],
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "initial_head": initial_head,
        "head": [np.asarray(w).tolist() for w in model.unused.get_weights()],
        "loss": history.history["loss"],
    }


def default_group() -> dict:
    """What the job's default process group is, whether it refuses a CPU
    tensor (as NCCL does), and a bounded barrier (gloo's monitored one)."""
    import torch
    import torch.distributed as torch_distributed

    try:
        torch_distributed.all_reduce(torch.ones(1))
        refused = None
    except RuntimeError as error:
        refused = str(error)
    get_adapter().barrier("default_group", timeout_seconds=60)
    return {"backend": torch_distributed.get_backend(), "cpu_refused": refused}


def branch_per_process() -> dict:
    """A layer that takes one of two Dense branches by the sign of its batch:
    process 0's rows take one, process 1's the other, so each process' loss
    misses the branch the other's reaches, every step."""
    from keras import ops

    class Branch(keras.layers.Layer):
        def build(self, shape):
            self.up, self.down = keras.layers.Dense(2), keras.layers.Dense(2)
            self.up.build(shape)
            self.down.build(shape)

        def call(self, x):
            positive = float(ops.convert_to_numpy(ops.mean(x[:, 0]))) > 0
            return self.up(x) if positive else self.down(x)

    worker_seed.set_random_seed(100 + kd.process_id())
    model = keras.Sequential([keras.Input((3,)), Branch()])
    model.compile(optimizer="adam", loss="mse")
    initial = [np.asarray(w).tolist() for w in model.get_weights()]
    x = np.abs(np.random.default_rng(0).normal(size=(32, 3))).astype("float32")
    x.reshape(4, 2, 4, 3)[:, 1] *= -1  # the second half of each batch of 8
    model.fit(
        x,
        np.ones((32, 2), "float32"),
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    return {
        "initial": initial,
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
    }


def main() -> None:
    scenarios_given, output = sys.argv[1], sys.argv[2]
    if "," in scenarios_given:
        # Several scenarios in turn in one job (one start-up: CI's time); the
        # result holds each one's under its name. Each starts from a cleared
        # Keras session: its models and layers get the names they would get in
        # a process of their own ("sequential", "dense"), which LayoutMap keys
        # and the tests' checks name.
        result = {}
        for name in scenarios_given.split(","):
            keras.backend.clear_session()
            result[name] = run(name, output)
    else:
        result = run(scenarios_given, output)
    result["process_id"] = kd.process_id()
    with open(output, "w") as handle:
        json.dump(result, handle)


def run(scenario: str, output: str) -> dict:
    if scenario == "train":
        result = scenarios.train(shuffle=True, verbose=1)
    elif scenario == "train_batch_norm":
        result = scenarios.train(batch_norm=True, shuffle=True, verbose=1)
    elif scenario == "train_local_batch_norm":
        result = scenarios.train(
            batch_norm=True, sync_batch_norm=False, shuffle=True, verbose=1
        )
    elif scenario == "own_data":
        result = own_data()
    elif scenario == "default_group":
        result = default_group()
    elif scenario == "branch_per_process":
        result = branch_per_process()
    elif scenario == "own_data_reference":
        result = own_data_reference()
    elif scenario == "lose_a_process":
        result = scenarios.lose_a_process()
    elif scenario == "unused_weight":
        result = unused_weight()
    elif scenario == "unused_weight_reference":
        result = unused_weight(distributed=False)
    elif scenario == "loader_mismatch":
        result = loader_mismatch()
    elif scenario.startswith("model_parallel"):
        import torch_model_parallel

        result = torch_model_parallel.run(scenario)
    elif scenario == "loaders":
        # Every DataLoader kind in one job: one start-up instead of three.
        result = {
            kind: loader_training(
                kind, pathlib.Path(output).with_suffix(f".{kind}.loads.jsonl")
            )
            for kind in ("shuffled", "drop_last", "iterable")
        }
    elif scenario.startswith("loader_"):
        record = pathlib.Path(output).with_suffix(".loads.jsonl")
        result = loader_training(scenario.removeprefix("loader_"), record)
    elif scenario == "every_kind":
        # Every input type in one job: one start-up instead of five.
        result = {"ids_by_kind": {kind: seen_ids(kind) for kind in INPUT_KINDS}}
    else:
        result = {"ids": seen_ids(scenario)}
    return result


if __name__ == "__main__":
    main()
