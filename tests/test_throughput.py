"""`kd.callbacks.Throughput` and the FLOP count behind it (issue 15, item 1)."""

from __future__ import annotations

import csv
import math
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import flops
from keras_dist.callbacks import Throughput
from tests.conftest import BACKEND
from tests.multiprocess import log_of, run_job

KEYS = {
    "samples_per_second",
    "step_time",
    "compute_time",
    "tflops_per_device",
}
DATA_KEYS = {"data_wait_time", "data_wait_fraction"}  # not on TensorFlow


def _mlp(name: str = "mlp") -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ],
        name=name,
    )
    model.compile(optimizer="sgd", loss=model_loss())
    return model


def model_loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.backend("jax")
def test_flop_count_is_exact_for_dense_and_conv_and_names_what_it_leaves_out():
    m, n, k = 6, 5, 7
    dense = keras.layers.Dense(k, name="dense")
    dense.build((None, n))
    count = flops.count_flops(dense, batch_size=m)
    assert count.forward == 2 * m * n * k
    assert count.training == 3 * 2 * m * n * k
    # Every row of a (batch, time, n) input is one row of the product.
    sequence = keras.layers.Dense(k, name="sequence")
    sequence.build((None, None, n))
    with_tokens = flops.count_flops(sequence, batch_size=m, tokens_per_sample=4)
    assert with_tokens.forward == 2 * (m * 4) * n * k
    # The unknown length, not given, is named instead of guessed.
    assert "tokens_per_sample" in flops.count_flops(sequence, 2).not_counted["sequence"]

    # Conv2D, 'valid', stride 2, 2 groups: 4 x 3 output positions, each
    # 3 * 3 * (4 / 2) multiply-adds for each of 6 filters.
    conv = keras.layers.Conv2D(6, 3, strides=2, groups=2, name="conv")
    conv.build((None, 9, 7, 4))
    assert (
        flops.count_flops(conv, batch_size=2).forward
        == 2 * 2 * (4 * 3) * (3 * 3 * 2) * 6
    )

    inputs = keras.Input((n,))
    shared = keras.layers.Dense(n, name="shared")
    hidden = shared(shared(inputs))
    hidden = keras.layers.Lambda(lambda t: t * 2, name="doubling")(hidden)
    outputs = keras.layers.Dropout(0.1, name="dropout")(hidden)
    model = keras.Model(inputs, outputs)
    count = flops.count_flops(model, batch_size=m)
    assert count.per_layer == {"shared": 2 * m * n * n}
    assert list(count.not_counted) == ["doubling"]
    assert "called 2 times" in count.notes["shared"]


class _SlowBatches(keras.utils.PyDataset):
    """Batches that take `seconds` each to read."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(6, 4, 8)).astype("float32")
        self.y = rng.integers(0, 3, size=(6, 4))

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        time.sleep(self.seconds)
        return self.x[index], self.y[index]


class _SlowCallbacks(keras.callbacks.Callback):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


@pytest.mark.backend("jax", "torch")
def test_data_wait_and_host_time_are_not_counted_as_compute():
    # No distribution: plain Keras on one device. Reading a batch takes 30 ms
    # and a later callback 20 ms; neither is compute.
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(3, name="logits")(inputs)
    outputs = keras.layers.Lambda(lambda t: t * 2, name="doubling")(hidden)
    model = keras.Model(inputs, outputs, name="with_lambda")
    model.compile(optimizer="sgd", loss=model_loss())
    throughput = Throughput(4, peak_flops_per_device=1e9, verbose=0)
    with pytest.warns(UserWarning, match=r"leaves out 1 layer.*\n.*doubling"):
        history = model.fit(
            _SlowBatches(0.03),
            epochs=1,
            verbose=0,
            callbacks=[throughput, _SlowCallbacks(0.02)],
        )
    logs = {key: values[-1] for key, values in history.history.items()}
    assert logs["data_wait_time"] >= 0.03
    host = logs["step_time"] - logs["compute_time"] - logs["data_wait_time"]
    assert host >= 0.02
    assert logs["data_wait_fraction"] == pytest.approx(
        logs["data_wait_time"] / logs["step_time"]
    )
    assert logs["mfu"] == pytest.approx(logs["tflops_per_device"] * 1e12 / 1e9)


def test_keys_reach_logs_and_csv_and_one_line_per_epoch(tmp_path, capsys):
    csv_path = tmp_path / "log.csv"
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=64)
    model = _mlp()
    distribution = kd.DataParallel()
    devices = distribution.device_mesh.devices.size
    throughput = Throughput(16, tokens_per_sample=8)
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(distribution),
            throughput,
            keras.callbacks.CSVLogger(str(csv_path)),
        ],
    )
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 2
    expected = KEYS | {"tokens_per_second"}
    if BACKEND != "tensorflow":
        expected |= DATA_KEYS
    absent = {"mfu", "slowest_rank", "step_time_spread"}  # CPU, one process
    forward = 2 * 16 * (8 * 16 + 16 * 3)  # the two Dense layers
    if BACKEND == "tensorflow":
        absent |= DATA_KEYS
    for row in rows:
        assert expected <= set(row) and not absent & set(row)
        values = {key: float(row[key]) for key in expected}
        assert all(math.isfinite(v) and v > 0 for v in values.values()), values
        assert values["samples_per_second"] == pytest.approx(16 / values["step_time"])
        assert values["tokens_per_second"] == pytest.approx(
            8 * values["samples_per_second"]
        )
        assert values["tflops_per_device"] == pytest.approx(
            3 * forward / values["step_time"] / 1e12 / devices
        )
    assert throughput.flop_count.training == 3 * forward
    printed = capsys.readouterr().out
    assert printed.count("Throughput epoch 1:") == 1
    assert printed.count("Throughput epoch 2:") == 1
    assert printed.count("CPUs have no meaningful peak") == 1


@pytest.mark.backend("jax")
def test_bad_arguments_raise():
    for kwargs, error in (
        ({"batch_size": 0}, ValueError),
        ({"batch_size": "64"}, TypeError),
        ({"batch_size": True}, TypeError),
        ({"batch_size": 8, "tokens_per_sample": -1}, ValueError),
        ({"batch_size": 8, "peak_flops_per_device": 0.0}, ValueError),
        ({"batch_size": 8, "peak_flops_per_device": "989e12"}, TypeError),
        ({"batch_size": 8, "flops_per_sample": math.inf}, ValueError),
        ({"batch_size": 8, "verbose": 2}, ValueError),
    ):
        with pytest.raises(error, match="Received"):
            Throughput(**kwargs)
    with pytest.raises(ValueError, match="batch_size=0"):
        flops.count_flops(keras.layers.Dense(2), batch_size=0)


@pytest.mark.backend("torch")
def test_two_processes_name_the_rank_that_sleeps_as_the_slowest(tmp_path):
    results = run_job(
        "throughput_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
        timeout=120,
    )
    zero, one = (result["history"] for result in results)
    assert zero == one  # the job's values, on every process
    assert zero["slowest_rank"] == [1]
    # Rank 1 sleeps 40 ms after every step: rank 0 waits about that long.
    assert 0.03 < zero["step_time_spread"][0] < 0.2
    assert "Throughput epoch 1:" in log_of(tmp_path, 0)
    assert "slowest rank 1" in log_of(tmp_path, 0)
    assert "Throughput" not in log_of(tmp_path, 1)
