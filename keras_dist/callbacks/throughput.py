"""`Throughput`: samples/s, data wait, TFLOP/s, MFU and the slowest process."""

from __future__ import annotations

import math
import time
from typing import Any

import keras

from keras_dist.backends import get_adapter
from keras_dist.callbacks.step_ledger import StepLedger, StepSeconds
from keras_dist.common.accelerators import peak_flops_per_device
from keras_dist.common.job import timeout_seconds, warn_once
from keras_dist.common.validation import check_positive_int
from keras_dist.flops import FlopCount, count_flops
from keras_dist.keras_compat.epoch_iterator import (
    time_batch_reads,
    watch_batch_plans,
)

# What each process contributes to the job's figures, in this order.
_OWN = (
    "elapsed",
    "compute",
    "data",
    "measured_steps",
    "measured_samples",
    "rows_known",
)


class Throughput(keras.callbacks.Callback):
    """Measure how fast `fit` trains, each epoch, into `logs` and one line.

    At the end of every epoch it adds to the epoch's `logs` (so `History`,
    `CSVLogger` and `TensorBoard` record them: put `Throughput` before them
    in `callbacks`) and, with `verbose=1`, process 0 prints one line:

    - `samples_per_second`: the real rows of the measured steps (a short
      last batch counts what it holds, padding never) over their time; with
      several processes, the rows of the whole global batch.
      `tokens_per_second` with `tokens_per_sample=`.
    - `measured_steps`, `measured_samples`, `left_out_steps`: what the
      figures cover, and how many steps they leave out (see below; the line
      names them and why).
    - `step_time`: seconds per step, from the end of one step to the end of
      the next (everything: reading the batch, the step, the callbacks,
      Keras' loop).
    - `data_wait_time`: seconds per step spent reading the next batch from
      the data iterator (`next()`; a tf.data pipeline, a DataLoader, a
      PyDataset); `data_wait_fraction`: that over `step_time`. On TensorFlow
      Keras reads each batch inside its compiled step, out of reach: both
      keys are absent there and `compute_time` includes the read.
    - `compute_time`: seconds per step inside the step (from
      `on_train_batch_begin` to `on_train_batch_end`, less the batch reads).
      It includes the time spent waiting for the other processes in the
      step's collectives. The rest of `step_time` is host work: other
      callbacks, Keras' loop.
    - `tflops_per_device`: the model's training FLOPs per sample
      (`keras_dist.flops.count_flops`: matrix multiplications and
      convolutions, a training step counted as 3 forward passes) times the
      measured samples (padding rows, computed but useless, not counted),
      over the time, over the devices of the active distribution (1 without
      one), in 10^12 FLOP/s.
    - `mfu`: `tflops_per_device` as a fraction of the device's dense peak, from
      `peak_flops_per_device=` or keras_dist's table of common accelerators
      (16-bit peak when the model computes in bfloat16 or float16, float32
      peak otherwise; where the engine multiplies float32 in TF32, as JAX
      does by default on NVIDIA GPUs since Ampere, the float32 peak understates
      what the device can do and MFU can exceed 1: pass the peak you mean).
      Absent when no peak is known, e.g. on CPUs, which have no meaningful
      one (the line says so once).
    - `slowest_rank`, `step_time_spread` (several processes only): the
      process the others wait for, and by how much. In synchronous training
      every process takes the same time per step (the collectives line them
      up); a process that is slow outside the step (data, callbacks, host
      work) makes the others wait inside theirs. So the slowest rank is the
      one with the most time per step outside the step (`step_time` less
      `compute_time`), and `step_time_spread` is its excess over the
      fastest's, in seconds per step: about what it costs every other
      process each step. A process that is slow inside the compiled step (a
      slower device) makes every process' `compute_time` longer alike and is
      not singled out.

    With several processes, every value in `logs` is the job's (times are
    the mean over processes; one small exchange of numbers at the end of each
    epoch), the same on every process, and `Throughput` must be in every
    process' callbacks (it waits for the others at most
    `KERAS_DIST_INIT_TIMEOUT` seconds). Under a keras_dist distribution
    `batch_size` is `fit`'s, the global batch, and the samples are the global
    batches' (with `auto_shard_dataset=False`, the sum of what each process
    reads); without one, each process' own batches and device (the mean over
    processes).

    How the times stay honest: `Throughput` has an `on_train_batch_end`, so
    Keras hands each step's logs over as Python numbers before calling it
    (as it does for the progress bar with `verbose=1` or `2`): the step has
    finished on the devices, and JAX's asynchronous dispatch cannot hide it.
    The price is that, with `verbose=0` and no other per-batch callback,
    Keras would otherwise read the logs on a background thread while it
    dispatches the next step; `benchmarks/entries/throughput_overhead.py`
    measures both costs.

    What the figures leave out, named in the line: the first step of every
    epoch (its time holds the epoch's start: the data iterator starting, and
    in the first epoch the compilation), and the first step of every batch
    size not seen before in this `fit` (on JAX and TensorFlow a new shape
    compiles the step again: the short last batch of the first epoch; later
    epochs count it, with its real rows). The rows of each step come from
    Keras' data adapter, which knows them for arrays, a sized torch
    `DataLoader` and a `tf.data.Dataset` with a static batch dimension; for
    other inputs (a generator, a `PyDataset`, a `tf.data.Dataset` whose last
    batch may be short) each step counts `batch_size` rows and the last step
    of every epoch is left out too, and a warning says so. Per step the
    callback's own work (two clock reads, the timed batch read, a few
    additions) took about 1 µs on the 2-core CI machine, against steps of
    milliseconds.

    Args:
        batch_size: the `batch_size` given to `fit` (the rows of a full
            step): for the FLOP count, and for the rows of a step when the
            input does not say them.
        tokens_per_sample: tokens in each sample, e.g. the sequence length:
            logs `tokens_per_second`, and gives the size of unknown (`None`)
            non-batch dimensions when counting FLOPs.
        flops_per_sample: training FLOPs per sample (forward and backward), to
            use instead of counting them from the model's layers.
        peak_flops_per_device: the dense peak FLOP/s of one device, for
            `mfu`, instead of keras_dist's table.
        verbose: 1 (default) to print one line per epoch on process 0, 0 for
            none.

    Example:

    ```python
    throughput = keras_dist.callbacks.Throughput(batch_size=512)
    model.fit(x, y, batch_size=512, epochs=2,
              callbacks=[keras_dist.DistributeCallback(keras_dist.DataParallel()),
                         throughput, keras.callbacks.CSVLogger("log.csv")])
    ```

    prints, on 8 simulated CPU devices (a 0.4 M-parameter MLP), one line per
    epoch (wrapped here) and, once, why there is no MFU:

    ```
    Throughput epoch 1: 14,488 samples/s | step 35.34 ms: data wait 0.91 ms
    (2.6%), compute 34.39 ms | 0.00433 TFLOP/s per device, MFU n/a (cpu) |
    30 of 32 steps measured (15,360 samples); left out: step 1 (the epoch's
    first: its time holds the start), step 32 (the first batch of 272 rows: a
    new shape compiles the step again)
    Throughput: no MFU: CPUs have no meaningful peak FLOP/s; pass
    peak_flops_per_device= to compare with one.
    ```
    """

    def __init__(
        self,
        batch_size: int,
        *,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops_per_device: float | None = None,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        check_positive_int("batch_size", batch_size, optional=False)
        check_positive_int("tokens_per_sample", tokens_per_sample, optional=True)
        _check_number("flops_per_sample", flops_per_sample)
        _check_number("peak_flops_per_device", peak_flops_per_device)
        if verbose not in (0, 1) or not isinstance(verbose, int):  # bools too
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        self.batch_size = batch_size
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.peak_flops_per_device = peak_flops_per_device
        self.verbose = int(verbose)
        #: The `FlopCount` of the model being trained (None with
        #: `flops_per_sample=`, or before the first step).
        self.flop_count: FlopCount | None = None
        self._stop_timing: Any = None
        self._stop_plans: Any = None
        self._ledger = StepLedger(batch_size)
        self._rows_global = True
        self._reset_epoch()

    # -- Keras' calls ------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        adapter = get_adapter()
        self._rank = adapter.process_id()
        self._processes = adapter.num_processes()
        distribution = keras.distribution.distribution()
        self._devices = 1
        if distribution is not None:
            self._devices = int(distribution.device_mesh.devices.size)
        # Whether every process counts the same global batches (else each its
        # own rows: summed under a distribution, averaged without one).
        self._rows_global = distribution is not None and (
            self._processes == 1 or getattr(distribution, "auto_shard_dataset", True)
        )
        self._sum_own_rows = distribution is not None and not self._rows_global
        self._device_kind = adapter.device_kind()
        self._peak = self.peak_flops_per_device or peak_flops_per_device(
            self._device_kind, str(self.model.dtype_policy.compute_dtype)
        )
        self._times_reads = adapter.reads_batches_in_python
        self._backend = adapter.name
        self.flop_count = None
        self._flops_per_sample: float | None = None
        self._said_once = False
        self._stop()
        self._ledger.new_fit()
        self._stop_plans = watch_batch_plans(self._ledger.plan_announced)
        if self._times_reads:
            self._stop_timing = time_batch_reads(self._record_read)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._stop()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._reset_epoch()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._begin = time.perf_counter()
        self._begin_step = batch
        self._in_step = True
        self._ledger.step_begins(batch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        self._in_step = False
        seconds = None
        if self._last_end is not None and self._begin is not None:
            # The first step of the epoch only starts the clock.
            seconds = StepSeconds(
                now - self._last_end,
                now - self._begin - self._reads_in_step,
                self._reads_between + self._reads_in_step,
            )
        self._ledger.step_ends(self._begin_step, batch, seconds)
        self._last_end = now
        self._reads_between = self._reads_in_step = 0.0
        if self._flops_per_sample is None:
            self._count_flops()
            self._last_end = time.perf_counter()  # counting is not a step's

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._ledger.epoch_ends()
        if not self._ledger.rows_known:
            self._warn_rows_unknown()
        values = self._job_values(self._own_numbers())
        if logs is not None:
            logs.update(values)
        if self.verbose and self._rank == 0:
            print(self._line(epoch, values), flush=True)
            if not self._said_once:
                self._said_once = True
                for note in self._notes():
                    print(f"Throughput: {note}", flush=True)

    # -- measuring ---------------------------------------------------------------
    def _reset_epoch(self) -> None:
        self._begin: float | None = None
        self._begin_step = 0
        self._last_end: float | None = None
        self._in_step = False
        self._reads_between = self._reads_in_step = 0.0
        self._ledger.new_epoch()

    def _record_read(self, seconds: float) -> None:
        if self._in_step:  # JAX: the step reads its batch itself
            self._reads_in_step += seconds
        else:  # PyTorch: Keras reads the batch before on_train_batch_begin
            self._reads_between += seconds

    def _stop(self) -> None:
        for name in ("_stop_timing", "_stop_plans"):
            stop = getattr(self, name)
            if stop is not None:
                stop()
                setattr(self, name, None)

    def _count_flops(self) -> None:
        if self.flops_per_sample is not None:
            self._flops_per_sample = float(self.flops_per_sample)
            return
        self.flop_count = count_flops(
            self.model, self.batch_size, tokens_per_sample=self.tokens_per_sample
        )
        self._flops_per_sample = float(self.flop_count.training) / self.batch_size
        if self.flop_count.not_counted:
            warn_once(
                f"Throughput: the FLOP count of model {self.model.name!r} leaves "
                f"out {len(self.flop_count.not_counted)} layer(s), so "
                "tflops_per_device and mfu are low (pass flops_per_sample= to "
                "give the figure):\n" + self.flop_count.describe_gaps(),
                UserWarning,
                stacklevel=2,
            )

    def _warn_rows_unknown(self) -> None:
        warn_once(
            f"Throughput: {self._ledger.input_type or 'the input'} does not say how "
            "many rows each batch holds, so samples_per_second counts "
            f"batch_size={self.batch_size} rows a measured step and leaves out the "
            "last step of every epoch (it may be short). Pass arrays, a sized "
            "DataLoader or a tf.data.Dataset batched with drop_remainder=True to "
            "count the real rows.",
            UserWarning,
            stacklevel=3,
            key=("throughput rows unknown", id(self)),
        )

    def _own_numbers(self) -> list[float]:
        """This process' epoch, in the order of `_OWN`."""
        ledger = self._ledger
        return [
            *ledger.seconds,
            float(ledger.measured_steps),
            float(ledger.measured_samples),
            float(ledger.rows_known),
        ]

    def _job_values(self, own: list[float]) -> dict[str, float]:
        everyone = [own]
        if self._processes > 1:
            everyone = get_adapter().gather_numbers(
                own, timeout_seconds=timeout_seconds()
            )
        columns = {
            name: list(column)
            for name, column in zip(_OWN, zip(*everyone, strict=True), strict=True)
        }
        count = len(everyone)
        steps = columns["measured_steps"][0]  # the same on every process
        elapsed = math.fsum(columns["elapsed"]) / count
        if not (steps and elapsed):  # no step measured
            steps = elapsed = math.nan
        own_rates = [
            rows / seconds if seconds else math.nan
            for rows, seconds in zip(
                columns["measured_samples"], columns["elapsed"], strict=True
            )
        ]
        if not all(columns["rows_known"]):
            samples = steps * self.batch_size  # as every process counted
            rate = samples / elapsed
        elif self._rows_global:  # every process counted the global batches
            samples = columns["measured_samples"][0]
            rate = samples / elapsed
        elif self._sum_own_rows:  # each its own share of the global batches
            samples = math.fsum(columns["measured_samples"])
            rate = math.fsum(own_rates)
        else:  # no distribution: each process' own batches
            samples = math.fsum(columns["measured_samples"]) / count
            rate = math.fsum(own_rates) / count
        step_time = elapsed / steps
        compute_time = math.fsum(columns["compute"]) / count / steps
        data_time = math.fsum(columns["data"]) / count / steps
        values = {"samples_per_second": rate}
        if self.tokens_per_sample is not None:
            values["tokens_per_second"] = rate * self.tokens_per_sample
        values["step_time"] = step_time
        if self._times_reads:
            values["data_wait_time"] = data_time
            values["data_wait_fraction"] = data_time / step_time
        values["compute_time"] = compute_time
        flops_per_device = (self._flops_per_sample or 0.0) * rate / self._devices
        values["tflops_per_device"] = flops_per_device / 1e12
        if self._peak:
            values["mfu"] = flops_per_device / self._peak
        values["measured_steps"] = float(self._ledger.measured_steps)
        values["measured_samples"] = float(samples)
        values["left_out_steps"] = float(self._ledger.left_out_steps)
        if self._processes > 1:
            outside = [
                (total - inside) / steps
                for total, inside in zip(
                    columns["elapsed"], columns["compute"], strict=True
                )
            ]
            if any(math.isnan(value) for value in outside):
                values["slowest_rank"] = values["step_time_spread"] = math.nan
            else:
                values["slowest_rank"] = max(
                    range(len(outside)), key=outside.__getitem__
                )
                values["step_time_spread"] = max(outside) - min(outside)
        return values

    # -- reporting ---------------------------------------------------------------
    def _line(self, epoch: int, values: dict[str, float]) -> str:
        ledger = self._ledger
        if math.isnan(values["step_time"]):
            return (
                f"Throughput epoch {epoch + 1}: no step measured of "
                f"{ledger.total_steps}; {ledger.describe_left_out()}"
            )
        parts = [f"{values['samples_per_second']:,.0f} samples/s"]
        if "tokens_per_second" in values:
            parts[0] += f" ({values['tokens_per_second']:,.0f} tokens/s)"
        step = f"step {values['step_time'] * 1e3:.2f} ms: "
        if "data_wait_time" in values:
            step += (
                f"data wait {values['data_wait_time'] * 1e3:.2f} ms "
                f"({values['data_wait_fraction']:.1%}), "
            )
        parts.append(step + f"compute {values['compute_time'] * 1e3:.2f} ms")
        mfu = f"MFU {_percent(values['mfu'])}" if "mfu" in values else "MFU n/a"
        if "mfu" not in values:
            mfu += f" ({self._device_kind})"
        parts.append(f"{values['tflops_per_device']:.3g} TFLOP/s per device, {mfu}")
        if "slowest_rank" in values and not math.isnan(values["slowest_rank"]):
            parts.append(
                f"slowest rank {values['slowest_rank']}: "
                f"+{values['step_time_spread'] * 1e3:.2f} ms/step"
            )
        counted = "samples" if ledger.rows_known else "samples, batch_size a step"
        parts.append(
            f"{ledger.measured_steps} of {ledger.total_steps} steps measured "
            f"({values['measured_samples']:,.0f} {counted}); "
            + ledger.describe_left_out()
        )
        return f"Throughput epoch {epoch + 1}: " + " | ".join(parts)

    def _notes(self) -> list[str]:
        notes = []
        if not self._peak:
            why = (
                "CPUs have no meaningful peak FLOP/s"
                if self._device_kind == "cpu"
                else f"no peak FLOP/s known for {self._device_kind!r}"
            )
            notes.append(
                f"no MFU: {why}; pass peak_flops_per_device= to compare with one."
            )
        if not self._times_reads:
            notes.append(
                f"no data wait: on {self._backend} Keras reads each batch inside "
                "the compiled step; compute_time includes the read."
            )
        if self.flop_count is not None:
            for path, note in self.flop_count.notes.items():
                notes.append(f"FLOP count: {path}: {note}")
        return notes


def _check_number(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"`{name}` must be a positive number of FLOPs or None. Received: "
            f"{name}={value!r} of type {type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a positive, finite number of FLOPs or None. "
            f"Received: {name}={value!r}"
        )


def _percent(fraction: float) -> str:
    """`fraction` as a percentage: one decimal from 1 % up (`"42.3%"`), two
    significant figures below (`"0.043%"`), so that a small MFU (a tiny model,
    a CPU-like peak) never reads as 0.0 %."""
    percent = fraction * 100
    if 0 < abs(percent) < 1:
        decimals = 1 - math.floor(math.log10(abs(percent)))
        small = f"{percent:.{decimals}f}"
        if abs(float(small)) < 1:  # 0.999 rounds to 1.00: shown as 1.0
            return f"{small}%"
    return f"{percent:.1f}%"
