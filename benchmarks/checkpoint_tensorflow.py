"""TensorFlow checkpoints: keras_dist's engine against a raw `tf.train.Checkpoint`.

All candidates train the same MLP (`benchmarks/mlp.py`, about 0.4 M
parameters, Adam) under `kd.DistributeCallback(kd.DataParallel())` on 4
simulated CPU devices (`MirroredStrategy`), in the same process, and save the
whole training state every `--every` steps into a new directory:

- `keras_dist`: `keras_dist.backends.tensorflow.checkpoint.save` (the
  TensorFlow variables behind the Keras ones, by structural key), the
  previous save waited for first, as `kd.Checkpoint` does;
- `native`: `tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  .write(prefix)`, the way TensorFlow users checkpoint a Keras model. Its
  background variant (`CheckpointOptions(enable_async=True)`) needs a new
  `tf.train.Checkpoint` for every save: with one object, the second write of a
  Keras 3 model raises ("tf.function only supports singleton tf.Variables";
  Keras' `Variable._copy_trackable_to_cpu` creates a variable on every call).
  keras_dist saves the TensorFlow variables themselves, which TensorFlow copies
  correctly, and reuses its object.

Each runs blocking and in the background; the fits are interleaved,
`--repeats` times. Reported, as medians: the step time without checkpoints;
the time of the save call; the cost of a save to training (the saving step and
the steps up to the next save, over as many plain steps: a background write
competes with those steps for the CPU; the last save's includes the final
wait); the extra time of the saving step alone; that cost as a share of the
training time between saves; and the ratios keras_dist/native.

```shell
KERAS_BACKEND=tensorflow KERAS_DIST_CPU_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 \
    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_tensorflow.py --repeats 3
```
"""

from __future__ import annotations

# keras_dist first: importing it creates the logical devices before TF starts.
import keras_dist as kd  # isort: skip

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import keras
import tensorflow as tf

from benchmarks.mlp import GLOBAL_BATCH, build_model, describe, synthetic_data
from keras_dist.backends.tensorflow import checkpoint as engine
from keras_dist.checkpoint.keys import saveable_variables

DEVICES = 4
WAIT_SECONDS = 120.0


class StepTimes(keras.callbacks.Callback):
    """The wall time of each step, from one step's start to the next's."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.starts.append(time.perf_counter())

    def on_train_end(self, logs=None):
        self.starts.append(time.perf_counter())

    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


class NoSaver(keras.callbacks.Callback):
    """The plain candidate: a batch-end hook that saves nothing, so that Keras
    ends every step the same way (synchronously) in every candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        return None


class Saver(keras.callbacks.Callback):
    """Saves every `every` steps into `root/step-<n>/` with its subclass'
    `save(directory)`; records each save call's duration."""

    def __init__(self, root: Path, every: int, background: bool) -> None:
        super().__init__()
        self.root, self.every, self.background = root, every, background
        self.calls: list[float] = []
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps % self.every:
            return
        directory = self.root / f"step-{self._steps}"
        directory.mkdir(parents=True)
        start = time.perf_counter()
        self.save(directory)
        self.calls.append(time.perf_counter() - start)


class EngineSaver(Saver):
    def on_train_begin(self, logs=None):
        self._state = saveable_variables(self.model)
        self._pending = None

    def save(self, directory: Path) -> None:
        if self._pending is not None:
            self._pending.wait(WAIT_SECONDS)
        self._pending = engine.save(directory, self._state, background=self.background)

    def on_train_end(self, logs=None):
        if self._pending is not None:
            self._pending.wait(WAIT_SECONDS)


class NativeSaver(Saver):
    def on_train_begin(self, logs=None):
        self._checkpoint = None
        self._options = tf.train.CheckpointOptions(enable_async=self.background)

    def save(self, directory: Path) -> None:
        if self._checkpoint is not None and self.background:
            self._checkpoint.sync()  # one save in flight, as keras_dist
            self._checkpoint = None  # a new object per async write (see above)
        if self._checkpoint is None:
            self._checkpoint = tf.train.Checkpoint(
                model=self.model, optimizer=self.model.optimizer
            )
        self._checkpoint.write(str(directory / "ckpt"), options=self._options)

    def on_train_end(self, logs=None):
        if self._checkpoint is not None:
            self._checkpoint.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    devices = kd.list_devices("cpu")
    if len(devices) < DEVICES or keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"Run with KERAS_BACKEND=tensorflow KERAS_DIST_CPU_DEVICES={DEVICES}."
        )

    model = build_model()
    x, y = synthetic_data(args.steps * GLOBAL_BATCH)
    distribution = kd.DataParallel(devices=devices[:DEVICES])
    scratch = Path(tempfile.mkdtemp(prefix="kd_checkpoint_bench_tf_"))

    def candidates(root: Path) -> dict:
        every = args.every
        return {
            "none": lambda: [NoSaver()],
            "keras_dist blocking": lambda: [EngineSaver(root / "kb", every, False)],
            "keras_dist background": lambda: [EngineSaver(root / "kg", every, True)],
            "native blocking": lambda: [NativeSaver(root / "nb", every, False)],
            "native background": lambda: [NativeSaver(root / "ng", every, True)],
        }

    def fit(callbacks: list) -> tuple[float, list[float]]:
        times = StepTimes()
        start = time.perf_counter()
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            shuffle=False,
            verbose=0,
            # The timer last: its `on_train_end` comes after the savers' final
            # wait, which the last step's time then includes.
            callbacks=[kd.DistributeCallback(distribution), *callbacks, times],
        )
        return time.perf_counter() - start, times.durations()

    results: dict[str, dict[str, list[float]]] = {}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up
            root = scratch / f"round-{repeat}"
            for name, make in candidates(root).items():
                callbacks = make()
                total, steps = fit(callbacks)
                if repeat:
                    entry = results.setdefault(
                        name, {"total": [], "steps": [], "calls": []}
                    )
                    entry["total"].append(total)
                    entry["steps"].extend(steps)
                    for callback in callbacks:
                        entry["calls"].extend(callback.calls)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    saves = args.steps // args.every
    plain_total = statistics.median(results["none"]["total"])
    plain_step = statistics.median(results["none"]["steps"])
    print(f"{describe(model)}, global batch {GLOBAL_BATCH}, {DEVICES} CPU devices")
    print(
        f"{args.steps} steps per fit, a save every {args.every} ({saves} saves), "
        f"{args.repeats} repeats; median step without checkpoints "
        f"{plain_step * 1e3:.1f} ms, fit {plain_total:.2f} s"
    )
    summary: dict[str, dict[str, float]] = {}
    for name, entry in results.items():
        if name == "none":
            continue
        steps = entry["steps"]
        # The steps whose end saved: every `every`-th, in each fit.
        saving = [
            i for i in range(len(steps)) if (i % args.steps + 1) % args.every == 0
        ]
        # What a save costs the training: the saving step and the steps up to
        # the next save (a background write competes with them for the CPU;
        # the last one includes the final wait), over as many plain steps.
        # Medians over saves: a spike of the shared machine hits one save.
        windows = []
        for i in saving:
            fit_end = i - i % args.steps + args.steps
            window = steps[i : min(i + args.every, fit_end)]
            windows.append(sum(window) - plain_step * len(window))
        per_save = statistics.median(windows)
        summary[name] = {
            "save_call_ms": statistics.median(entry["calls"]) * 1e3,
            "cost_per_save_ms": per_save * 1e3,
            "saving_step_extra_ms": statistics.median(
                steps[i] - plain_step for i in saving
            )
            * 1e3,
            "overhead_per_step_pct": 100 * per_save / (args.every * plain_step),
        }
    print(
        f"{'candidate':24} {'save call':>10} {'cost/save':>10} {'save step +':>12} "
        f"{'overhead':>9}"
    )
    for name, row in summary.items():
        print(
            f"{name:24} {row['save_call_ms']:8.1f}ms {row['cost_per_save_ms']:8.1f}ms "
            f"{row['saving_step_extra_ms']:10.1f}ms "
            f"{row['overhead_per_step_pct']:8.1f}%"
        )
    for mode in ("blocking", "background"):
        ours = summary[f"keras_dist {mode}"]
        native = summary[f"native {mode}"]
        print(
            f"ratio keras_dist/native, {mode}: save call "
            f"{ours['save_call_ms'] / native['save_call_ms']:.2f}, cost per save "
            f"{ours['cost_per_save_ms'] / native['cost_per_save_ms']:.2f}, "
            f"saving step "
            f"{ours['saving_step_extra_ms'] / native['saving_step_extra_ms']:.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "raw": results}))


if __name__ == "__main__":
    main()
