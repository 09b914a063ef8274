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
from keras_dist.callbacks import throughput as throughput_module
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


class _Clock:
    """`Throughput`'s clock, moved by `_StepTimes` only: exact step times."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class _StepTimes(keras.callbacks.Callback):
    """Before `Throughput` in `callbacks`: each step takes `seconds(epoch,
    batch)` on `clock`, all of it inside the step."""

    def __init__(self, clock: _Clock, seconds) -> None:
        super().__init__()
        self.clock, self.seconds, self.epoch = clock, seconds, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.clock.now += self.seconds(self.epoch, batch)


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(throughput_module, "time", fake)
    return fake


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
    with (
        pytest.warns(UserWarning, match=r"leaves out 1 layer.*\n.*doubling"),
        pytest.warns(UserWarning, match="PyDataset does not say how many rows"),
    ):
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
    assert zero["slowest_rank"] == [1, 1]
    # Rank 1 sleeps 40 ms after every step: rank 0 waits about that long.
    assert all(0.03 < spread < 0.2 for spread in zero["step_time_spread"])
    # The global batches' real rows, counted once (each process reads half):
    # epoch 1 leaves out step 1 and step 8 (the first batch of 8 rows), epoch
    # 2 step 1 only.
    assert zero["measured_steps"] == [6, 7]
    assert zero["measured_samples"] == [6 * 16, 6 * 16 + 8]
    for samples, rate, step_time, steps in zip(
        zero["measured_samples"],
        zero["samples_per_second"],
        zero["step_time"],
        zero["measured_steps"],
        strict=True,
    ):
        assert rate == pytest.approx(samples / (step_time * steps), rel=1e-9)
    assert "Throughput epoch 1:" in log_of(tmp_path, 0)
    assert "slowest rank 1" in log_of(tmp_path, 0)
    assert "Throughput" not in log_of(tmp_path, 1)


# -- the real rows of an uneven epoch (issue 25, item 7) -----------------------------
# 204 rows in batches of 16: 12 full batches and one of 12 rows (padded to 16 on
# 8 devices, the padding masked). A step takes 10 ms per 16 rows, 0.625 ms a
# row, so the true rate is 1,600 samples/s; the short last batch of the first
# epoch takes 500 ms instead, as compiling a new shape does on JAX.
ROWS, BATCH, FULL_STEPS, LAST_ROWS = 204, 16, 12, 12
TRUE_RATE = 1600.0


def _uneven_step_seconds(epoch: int, batch: int) -> float:
    if batch == FULL_STEPS:  # the short last batch
        return 0.5 if epoch == 0 else LAST_ROWS / TRUE_RATE
    return BATCH / TRUE_RATE


def test_samples_per_second_counts_the_real_rows_of_an_uneven_epoch(clock, capsys):
    x = np.random.default_rng(0).normal(size=(ROWS, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=ROWS)
    model = _mlp()
    distribution = kd.DataParallel()
    devices = distribution.device_mesh.devices.size
    throughput = Throughput(BATCH, tokens_per_sample=4)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(distribution),
            _StepTimes(clock, _uneven_step_seconds),
            throughput,
        ],
    )
    logs = history.history
    # Hand count. Epoch 1: steps 2-12, 11 x 16 rows in 11 x 10 ms (step 1
    # starts the clock; step 13, the first batch of 12 rows, compiled). Epoch
    # 2: steps 2-13, 11 x 16 + 12 rows in 117.5 ms. Before, the figure was
    # batch_size / step time: 16 / (610 ms / 12) = 315 samples/s (5.1x off),
    # then 16 / (117.5 ms / 12) = 1,634 (the short batch counted as full).
    assert logs["measured_steps"] == [11.0, 12.0]
    assert logs["measured_samples"] == [176.0, 188.0]
    assert logs["left_out_steps"] == [2.0, 1.0]
    assert logs["samples_per_second"] == pytest.approx([TRUE_RATE] * 2, rel=1e-9)
    assert logs["tokens_per_second"] == pytest.approx([4 * TRUE_RATE] * 2, rel=1e-9)
    assert logs["step_time"] == pytest.approx([0.01, 0.1175 / 12], rel=1e-9)
    per_sample = throughput.flop_count.training / BATCH
    assert logs["tflops_per_device"] == pytest.approx(
        [per_sample * TRUE_RATE / devices / 1e12] * 2, rel=1e-9
    )
    printed = capsys.readouterr().out
    assert (
        "11 of 13 steps measured (176 samples); left out: step 1 (the epoch's "
        "first: its time holds the start), step 13 (the first batch of 12 rows: a "
        "new shape compiles the step again)"
    ) in printed
    assert (
        "12 of 13 steps measured (188 samples); left out: step 1 (the epoch's "
        "first: its time holds the start)"
    ) in printed


class _UnevenBatches(keras.utils.PyDataset):
    """4 batches of 16 rows and one of 12: sizes Keras cannot know ahead."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(76, 8)).astype("float32")
        self.y = rng.integers(0, 3, size=76)

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int):
        rows = slice(16 * index, min(16 * index + 16, 76))
        return self.x[rows], self.y[rows]


def test_an_input_without_batch_sizes_is_said_and_its_last_step_left_out(clock, capsys):
    model = _mlp()
    seconds = lambda epoch, batch: 0.010  # noqa: E731
    with pytest.warns(UserWarning, match="does not say how many rows each batch"):
        history = model.fit(
            _UnevenBatches(),
            epochs=1,
            verbose=0,
            callbacks=[
                kd.DistributeCallback(kd.DataParallel()),
                _StepTimes(clock, seconds),
                Throughput(16),
            ],
        )
    logs = {key: values[-1] for key, values in history.history.items()}
    # Steps 2-4 count 16 rows each; step 5, maybe short, is left out.
    assert logs["measured_steps"] == 3
    assert logs["measured_samples"] == 48
    assert logs["samples_per_second"] == pytest.approx(1600.0, rel=1e-9)
    assert (
        "3 of 5 steps measured (48 samples, batch_size a step); left out: step 1 "
        "(the epoch's first: its time holds the start), step 5 (the epoch's last: "
        "it may hold fewer rows, unknown here)"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    "mfu, printed",
    # A small MFU used to print as "MFU 0.0%" (and 0.52 % as "MFU 0.5%").
    [(0.00043, "MFU 0.043%"), (0.0052, "MFU 0.52%"), (0.423, "MFU 42.3%")],
)
def test_a_small_mfu_is_printed_with_two_significant_figures(
    clock, capsys, mfu, printed
):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=64)
    distribution = kd.DataParallel()
    devices = distribution.device_mesh.devices.size
    peak = 1e12
    # 16 rows every 10 ms: 1600 samples/s, so FLOP/s per device = this x 1600
    # / devices, a fraction `mfu` of the peak.
    per_sample = mfu * peak * devices / 1600
    history = _mlp().fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(distribution),
            _StepTimes(clock, lambda epoch, batch: 0.010),
            Throughput(16, flops_per_sample=per_sample, peak_flops_per_device=peak),
        ],
    )
    assert history.history["mfu"] == pytest.approx([mfu], rel=1e-9)
    assert f"TFLOP/s per device, {printed} |" in capsys.readouterr().out


@pytest.mark.backend("jax")
def test_batch_plans_of_keras_adapters():
    import tensorflow as tf  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        array_data_adapter,
        tf_dataset_adapter,
        torch_data_loader_adapter,
    )

    from keras_dist.keras_compat import batch_plans  # noqa: PLC0415

    arrays = array_data_adapter.ArrayDataAdapter(np.zeros((10, 2)), batch_size=4)
    plan = batch_plans.batch_plan(arrays)
    assert [plan.rows(i) for i in range(4)] == [4, 4, 2, 0]
    assert plan.input_type == "arrays"
    dataset = torch.utils.data.TensorDataset(torch.zeros(10, 2))
    for drop_last, rows in ((False, [4, 4, 2, 0]), (True, [4, 4, 0, 0])):
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=drop_last)
        adapter = torch_data_loader_adapter.TorchDataLoaderAdapter(loader)
        plan = batch_plans.batch_plan(adapter)
        assert [plan.rows(i) for i in range(4)] == rows
    sampler = torch.utils.data.BatchSampler(range(10), 3, drop_last=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    adapter = torch_data_loader_adapter.TorchDataLoaderAdapter(loader)
    assert batch_plans.batch_plan(adapter) is None  # the user's sampler decides
    batched = tf.data.Dataset.from_tensor_slices(np.zeros((10, 2)))
    exact = tf_dataset_adapter.TFDatasetAdapter(batched.batch(4, drop_remainder=True))
    assert batch_plans.batch_plan(exact).rows(1) == 4
    uneven = tf_dataset_adapter.TFDatasetAdapter(batched.batch(4))
    assert batch_plans.batch_plan(uneven) is None


@pytest.mark.backend("jax")
def test_the_step_ledger_follows_resumed_and_multi_step_epochs():
    from keras_dist.callbacks.step_ledger import StepLedger, StepSeconds  # noqa: PLC0415
    from keras_dist.keras_compat.batch_plans import BatchPlan  # noqa: PLC0415

    class Iterator:  # stands for fit's epoch iterator (only its identity counts)
        pass

    fit, validation = Iterator(), Iterator()
    second = StepSeconds(1.0, 0.5, 0.1)
    ledger = StepLedger(batch_size=16)
    # An epoch resumed at batch 4 of 6 (the last holds 5 rows), 2 batches a
    # call (steps_per_execution=2).
    ledger.plan_announced(fit, BatchPlan(16, 6, 5, "arrays"), "arrays")
    ledger.step_begins(4)
    ledger.step_ends(4, 5, None)
    assert ledger.left_out_steps == 2 and ledger.measured_steps == 0
    # A validation iterator's plan is not fit's.
    ledger.plan_announced(validation, BatchPlan(3, 1, 3, "arrays"), "arrays")
    ledger.new_epoch()
    ledger.plan_announced(fit, BatchPlan(16, 6, 5, "arrays"), "arrays")
    for first in (0, 2, 4):
        ledger.step_begins(first)
        ledger.step_ends(first, first + 1, None if first == 0 else second)
    ledger.epoch_ends()
    # Batches 3-4 count 32 rows; 5-6 (16 and 5 rows) are a size seen before.
    assert (ledger.measured_steps, ledger.measured_samples) == (4, 32 + 21)
    assert ledger.seconds == StepSeconds(2.0, 1.0, 0.2)
    assert ledger.describe_left_out() == (
        "left out: steps 1-2 (the epoch's first: its time holds the start)"
    )
    # Without a plan: batch_size rows a step, the last step left out.
    unknown = StepLedger(batch_size=8)
    for batch in range(7):
        unknown.step_begins(batch)
        unknown.step_ends(batch, batch, None if batch == 0 else second)
    unknown.epoch_ends()
    assert not unknown.rows_known
    assert (unknown.measured_steps, unknown.measured_samples) == (5, 40)
    assert unknown.describe_left_out() == (
        "left out: step 1 (the epoch's first: its time holds the start), step 7 "
        "(the epoch's last: it may hold fewer rows, unknown here)"
    )
