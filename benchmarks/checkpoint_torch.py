"""PyTorch checkpoints: keras_dist's engine against a plain DCP save loop.

In 2 processes (one CPU device each, gloo), for DataParallel (DDP) and for
ModelParallel (DTensor, the hidden kernels split between the processes), the
same MLP 256-512-512-10 with Adam (about 0.4 M parameters, 1.2 M values with
the slots), saved:

- `keras_dist`: `keras_dist.backends.torch.checkpoint.save(directory,
  saveable_variables(model), background=...)`: Keras' structural keys, its own
  gloo group, metric states reduced, blocking or in the background.
- `native`: `torch.distributed.checkpoint.save({variable.path: variable.value
  for every model and optimizer variable}, checkpoint_id=directory)`: what a
  torch user writes by hand on the default process group.

Reported (process 0): the time one blocking save takes and the time until a
background save returns (training may go on), each the median of several
saves; and the median training step time of a `fit` of STEPS steps that saves
every EVERY steps, keras_dist blocking and background against the native loop,
with ratios keras_dist / native.

```shell
KERAS_BACKEND=torch PYTHONPATH=. .venv/bin/python -m keras_dist launch \
    --nproc-per-node 2 benchmarks/checkpoint_torch.py [--json OUT]
```
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_dist as kd  # noqa: E402  (joins the job before anything else)

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as torch_distributed  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from benchmarks.harness import StepTimer  # noqa: E402
from keras_dist.backends.torch import checkpoint  # noqa: E402
from keras_dist.checkpoint.keys import saveable_variables  # noqa: E402

torch.set_num_threads(1)  # 2 processes share a 2-core machine
BATCH, STEPS, EVERY, SAVES = 128, 60, 10, 7


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(512, activation="relu", name="h1"),
            keras.layers.Dense(512, activation="relu", name="h2"),
            keras.layers.Dense(10, name="logits"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def distribution(mode: str):
    if mode == "ddp":
        return kd.DataParallel()
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["h1/kernel"] = (None, "model")
    layout_map["h2/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


class Directories:
    """A fresh, empty directory every process sees, per save."""

    def __init__(self, root: str):
        self.root, self.count = root, 0

    def next(self) -> str:
        self.count += 1
        path = os.path.join(self.root, f"save-{self.count}")
        if kd.process_id() == 0:
            os.makedirs(path)
        torch_distributed.barrier()
        return path


def native_save(model: keras.Model, path: str) -> None:
    variables = [*model.variables, *model.optimizer.variables]
    dcp.save({v.path: v.value for v in variables}, checkpoint_id=path)


class Saver(keras.callbacks.Callback):
    """Saves every EVERY steps inside `fit` (`how`: blocking, background,
    native or none) and, at the first batch end of a `probe` fit, times
    single saves."""

    def __init__(self, how: str, directories: Directories, probe: bool = False):
        super().__init__()
        self.how, self.directories, self.probe = how, directories, probe
        self.pending = None
        self.timings: dict[str, list[float]] = {}

    def _save(self, how: str) -> float:
        path = self.directories.next()
        start = time.perf_counter()
        if how == "native":
            native_save(self.model, path)
        else:
            state = saveable_variables(self.model)
            self.pending = checkpoint.save(path, state, background=how == "background")
        return time.perf_counter() - start

    def on_train_batch_end(self, batch, logs=None):
        if self.probe and batch == 0:
            for _ in range(SAVES):
                for how in ("blocking", "background", "native"):
                    self.timings.setdefault(how, []).append(self._save(how))
                    if self.pending is not None:
                        start = time.perf_counter()
                        self.pending.wait(120)
                        if how == "background":
                            self.timings.setdefault("background_total", []).append(
                                self.timings[how][-1] + time.perf_counter() - start
                            )
                        self.pending = None
        if self.how != "none" and not self.probe and (batch + 1) % EVERY == 0:
            self._save(self.how)

    def on_train_end(self, logs=None):
        if self.pending is not None:
            self.pending.wait(120)


def run(mode: str, root: str) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 256)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * STEPS,))
    directories = Directories(os.path.join(root, mode))

    def fit(saver: Saver) -> list[float]:
        model, timer = build(), StepTimer()
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[kd.DistributeCallback(distribution(mode)), saver, timer],
        )
        return timer.step_times(skip_steps=5)

    probe = Saver("none", directories, probe=True)
    fit(probe)
    medians = {k: statistics.median(v) for k, v in probe.timings.items()}
    steps: dict[str, list[float]] = {}
    for _ in range(2):  # interleaved
        for how in ("none", "native", "blocking", "background"):
            steps.setdefault(how, []).extend(fit(Saver(how, directories)))
    step_medians = {k: statistics.median(v) for k, v in steps.items()}
    # The mean includes the saving steps (1 in EVERY), the median does not.
    step_means = {k: statistics.fmean(v) for k, v in steps.items()}
    return {
        "save_s": medians,
        "blocking_over_native": medians["blocking"] / medians["native"],
        "background_return_over_native": medians["background"] / medians["native"],
        "step_median_s": step_medians,
        "step_mean_s": step_means,
        "step_mean_over_native": {
            how: step_means[how] / step_means["native"]
            for how in ("blocking", "background", "none")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here (process 0)")
    parser.add_argument("--modes", default="ddp,mp")
    args = parser.parse_args()
    root = None
    if kd.process_id() == 0:
        root = tempfile.mkdtemp(prefix="kd-checkpoint-bench-")
    shared = [root]
    torch_distributed.broadcast_object_list(shared, src=0)
    root = shared[0]
    try:
        result = {mode: run(mode, root) for mode in args.modes.split(",")}
    finally:
        torch_distributed.barrier()
        if kd.process_id() == 0:
            shutil.rmtree(root, ignore_errors=True)
    if kd.process_id() == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            with open(args.json, "w") as file:
                file.write(text)


if __name__ == "__main__":
    main()
