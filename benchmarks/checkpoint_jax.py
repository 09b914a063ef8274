"""JAX checkpoints: keras_dist's Orbax engine against Keras' `OrbaxCheckpoint`.

Both candidates train the same MLP (`benchmarks/mlp.py`, about 0.4 M parameters,
Adam) under `kd.DistributeCallback(kd.DataParallel())` on 8 simulated CPU
devices, in the same process, and save the whole training state every
`--every` steps:

- `keras_dist`: `keras_dist.backends.jax.checkpoint.save` (each process its own
  shards, Orbax with coordination-service barriers) into a new step directory,
  the previous save waited for first, as `kd.Checkpoint` does;
- `native`: `keras.callbacks.OrbaxCheckpoint(save_freq=every)` (Orbax v1,
  `max_to_keep=1`).

Each candidate runs blocking (`background=False` / `save_on_background=False`)
and in the background. Everything happens in one `fit` (on 2 busy CPU cores a
second `fit` of an 8-device DataParallel model sometimes deadlocks in XLA's CPU
all-reduce, checkpoints or not): each epoch is one candidate's turn, `--steps`
steps with a save every `--every`, its last save waited for before the epoch
ends; the turns rotate, `--repeats` times after a warm-up round. Reported: the
median step time without checkpoints, each candidate's cost per save (the extra
wall time of its epoch over a plain epoch, per save, final wait included), the
extra time of the steps that save (median), and the ratios keras_dist/native.

```shell
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 PYTHONPATH=. \
    .venv/bin/python benchmarks/checkpoint_jax.py --repeats 3
```
"""

from __future__ import annotations

# keras_dist first: importing it applies KERAS_DIST_CPU_DEVICES before JAX starts.
import keras_dist as kd  # isort: skip

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import keras

from benchmarks.mlp import GLOBAL_BATCH, build_model, describe, synthetic_data
from keras_dist.backends.jax import checkpoint as engine
from keras_dist.checkpoint.keys import saveable_variables

WAIT_SECONDS = 120.0


class EngineSaver:
    """keras_dist's engine: a new step directory per save, the previous save
    waited for first (as `kd.Checkpoint` does)."""

    def __init__(self, root: Path, background: bool) -> None:
        self.root, self.background = root, background
        self.root.mkdir(parents=True)
        self._pending = None
        self._saves = 0

    def save(self, model: keras.Model) -> None:
        if self._pending is not None:
            self._pending.wait(WAIT_SECONDS)
        self._saves += 1
        directory = self.root / f"step-{self._saves}"
        directory.mkdir()
        state = saveable_variables(model)
        self._pending = engine.save(directory, state, background=self.background)

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.wait(WAIT_SECONDS)


class NativeSaver:
    """Keras' `OrbaxCheckpoint(save_freq=1)`, given only the steps that save."""

    def __init__(self, root: Path, background: bool) -> None:
        self.callback = keras.callbacks.OrbaxCheckpoint(
            str(root), save_freq=1, save_on_background=background
        )
        self._batch = 0

    def save(self, model: keras.Model) -> None:
        self.callback.on_train_batch_end(self._batch)
        self._batch += 1

    def finish(self) -> None:
        self.callback.wait_until_finished()


class Rotation(keras.callbacks.Callback):
    """Epoch `e` is candidate `e % len(names)`'s turn: it saves every `every`
    steps and its last save is waited for at the epoch's end; the wall time of
    each epoch and of each step is recorded."""

    def __init__(self, savers: dict, every: int) -> None:
        super().__init__()
        self.savers, self.every = savers, every
        self.names = list(savers)
        self.epochs: list[tuple[str, float, list[float]]] = []

    def set_model(self, model):
        super().set_model(model)
        for saver in self.savers.values():
            if isinstance(saver, NativeSaver):
                saver.callback.set_model(model)

    def on_epoch_begin(self, epoch, logs=None):
        self._name = self.names[epoch % len(self.names)]
        self._steps: list[float] = []
        self._start = self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        saver = self.savers[self._name]
        if saver is not None and (batch + 1) % self.every == 0:
            saver.save(self.model)  # `model` brings JAX's state into the variables
        now = time.perf_counter()
        self._steps.append(now - self._last)
        self._last = now

    def on_epoch_end(self, epoch, logs=None):
        saver = self.savers[self._name]
        if saver is not None:
            saver.finish()
        self.epochs.append((self._name, time.perf_counter() - self._start, self._steps))

    def on_train_end(self, logs=None):
        for saver in self.savers.values():
            if isinstance(saver, NativeSaver):
                saver.callback.on_train_end()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if len(keras.distribution.list_devices()) != 8:
        raise RuntimeError("Run with KERAS_DIST_CPU_DEVICES=8 KERAS_BACKEND=jax.")

    model = build_model()
    x, y = synthetic_data(args.steps * GLOBAL_BATCH)
    scratch = Path(tempfile.mkdtemp(prefix="kd_checkpoint_bench_"))
    try:
        savers = {
            "none": None,
            "keras_dist blocking": EngineSaver(scratch / "kd_blocking", False),
            "keras_dist background": EngineSaver(scratch / "kd_background", True),
            "native blocking": NativeSaver(scratch / "native_blocking", False),
            "native background": NativeSaver(scratch / "native_background", True),
        }
        rotation = Rotation(savers, args.every)
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=len(savers) * (args.repeats + 1),
            shuffle=False,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel()), rotation],
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results: dict[str, dict[str, list[float]]] = {}
    for name, total, steps in rotation.epochs[len(savers) :]:  # after warm-up
        entry = results.setdefault(name, {"total": [], "steps": []})
        entry["total"].append(total)
        entry["steps"].extend(steps)

    saves = args.steps // args.every
    plain_total = statistics.median(results["none"]["total"])
    plain_step = statistics.median(results["none"]["steps"])
    print(f"{describe(model)}, global batch {GLOBAL_BATCH}, 8 CPU devices")
    print(
        f"{args.steps} steps per turn, a save every {args.every} ({saves} saves), "
        f"{args.repeats} turns each; without checkpoints: median step "
        f"{plain_step * 1e3:.1f} ms, turn {plain_total:.2f} s"
    )
    summary: dict[str, dict[str, float]] = {}
    for name, entry in results.items():
        if name == "none":
            continue
        per_save = (statistics.median(entry["total"]) - plain_total) / saves
        steps = entry["steps"]
        saving = [
            steps[i] - plain_step
            for i in range(len(steps))
            if (i % args.steps + 1) % args.every == 0
        ]
        summary[name] = {
            "cost_per_save_ms": per_save * 1e3,
            "saving_step_extra_ms": statistics.median(saving) * 1e3,
            "overhead_pct": 100 * per_save * saves / plain_total,
        }
    print(f"{'candidate':24} {'cost/save':>10} {'save step +':>12} {'overhead':>9}")
    for name, row in summary.items():
        print(
            f"{name:24} {row['cost_per_save_ms']:8.1f}ms "
            f"{row['saving_step_extra_ms']:10.1f}ms "
            f"{row['overhead_pct']:8.1f}%"
        )
    for mode in ("blocking", "background"):
        ours = summary[f"keras_dist {mode}"]
        native = summary[f"native {mode}"]
        print(
            f"ratio keras_dist/native, {mode}: cost per save "
            f"{ours['cost_per_save_ms'] / native['cost_per_save_ms']:.2f}, "
            "saving step "
            f"{ours['saving_step_extra_ms'] / native['saving_step_extra_ms']:.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "raw": results}))


if __name__ == "__main__":
    main()
