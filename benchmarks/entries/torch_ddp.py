"""PyTorch DDP: keras_dist's `fit` against a hand-written DDP training loop.

Both candidates train the same Keras convnet (built from the same seed) on the
same synthetic 28x28x1 images with the same global batch, in the same 2
processes (one CPU device each, gloo), taking turns:

- `keras_dist`: a plain `model.fit(x, y, batch_size=GLOBAL_BATCH, callbacks=[
  kd.DistributeCallback(kd.DataParallel())])`. keras_dist wraps the model in
  `DistributedDataParallel` for the `fit`, gives each process its half of every
  global batch, and keeps the logs global and the replicas equal.
- `torch_loop`: what the keras.io guide "Multi-GPU distributed training with
  PyTorch" does: a `TensorDataset` read through a `DistributedSampler` and a
  `DataLoader` (per-process batch GLOBAL_BATCH / 2), the Keras model wrapped in
  `DistributedDataParallel` once and called directly, `torch.optim.Adam`,
  `torch.nn.CrossEntropyLoss`, `loss.item()` every step.

Both use Adam with the same learning rate and epsilon and the same loss; the
Keras model is compiled with no extra metrics, so both read one loss per step.
keras_dist does more per step than the loop, as it promises: its logs are the
global values (metric states all-reduced) and batch norm's moving statistics
are averaged over the processes; the loop logs its own loss and lets them drift.
Dropout and batch normalization run in training mode in both (the loop passes
`training=True`). Steps are timed by the same `StepTimer` (the loop calls its
hooks itself); every process times, process 0 writes the result.

Each process uses one torch thread: 2 processes share a 2-core machine.

Run it through the runner (which starts it under `keras-dist launch`), or:

```shell
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/entries/torch_ddp.py --repeats 3
```
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_dist as kd  # noqa: E402  (joins the job before anything else)

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as torch_distributed  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    Candidate,
    entry_arguments,
    report,
    require_processes,
    run_interleaved,
)
from benchmarks.mlp import fit_steps  # noqa: E402

PROCESSES = 2
GLOBAL_BATCH = 128
IMAGE_SHAPE = (28, 28, 1)
CLASSES = 10
LEARNING_RATE = 1e-3
EPSILON = 1e-7
SEED = 1234


def build_model() -> keras.Model:
    """A guide-style convnet: convolutions with batch norm, dense with dropout."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input(IMAGE_SHAPE)
    x = inputs
    for filters, kernel_size, strides in ((16, 3, 1), (32, 5, 2), (48, 5, 2)):
        x = keras.layers.Conv2D(
            filters, kernel_size, strides=strides, padding="same", use_bias=False
        )(x)
        x = keras.layers.BatchNormalization(center=True, scale=False)(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(CLASSES)(x)
    model = keras.Model(inputs, outputs, name="guide_convnet")
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE, epsilon=EPSILON),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def synthetic_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.uniform(size=(rows, *IMAGE_SHAPE)).astype("float32")
    y = rng.integers(0, CLASSES, size=(rows,)).astype("int64")
    return x, y


class _History:
    """What the harness reads from a `fit`'s return value."""

    def __init__(self, loss: float):
        self.history = {"loss": [loss]}


def processes_agreeing(model: keras.Model) -> int:
    """How many processes hold the same trainable weights as process 0."""
    flat = torch.cat([v.value.detach().reshape(-1) for v in model.trainable_weights])
    gathered = [torch.empty_like(flat) for _ in range(kd.num_processes())]
    torch_distributed.all_gather(gathered, flat)
    return sum(bool(torch.equal(part, gathered[0])) for part in gathered)


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    require_processes(PROCESSES)
    torch.set_num_threads(1)
    world_size, rank = kd.num_processes(), kd.process_id()
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    # -- keras_dist: a plain fit with the callback ------------------------------
    def keras_dist_fit(distribution: kd.DataParallel) -> tuple[keras.Model, Any]:
        model = build_model()

        def callbacks() -> list:
            return [kd.DistributeCallback(distribution)]

        return model, fit_steps(model, x, y, callbacks, batch_size=GLOBAL_BATCH)

    # Per-process batch statistics, as the loop computes them.
    kd_model, fit_kd = keras_dist_fit(kd.DataParallel(sync_batch_norm=False))
    # The default: statistics of the global batch (SyncBatchNorm), exact.
    sync_model, fit_sync = keras_dist_fit(kd.DataParallel())

    # -- the hand-written loop of the guide ----------------------------------------
    loop_model = build_model()
    ddp_model = DistributedDataParallel(loop_model)  # broadcasts rank 0's weights
    optimizer = torch.optim.Adam(loop_model.parameters(), lr=LEARNING_RATE, eps=EPSILON)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_torch, y_torch = torch.from_numpy(x), torch.from_numpy(y)

    def fit_loop(steps: int, callbacks: list) -> _History:
        rows = steps * GLOBAL_BATCH
        dataset = TensorDataset(x_torch[:rows], y_torch[:rows])
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=False
        )
        loader = DataLoader(
            dataset, sampler=sampler, batch_size=GLOBAL_BATCH // world_size
        )
        for callback in callbacks:
            callback.on_train_begin()
        running_loss = 0.0
        for step, (inputs, targets) in enumerate(loader):
            outputs = ddp_model(inputs, training=True)
            loss = loss_fn(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            for callback in callbacks:
                callback.on_train_batch_end(step)
        # After the last timed step: the mean loss over processes, as fit logs it.
        total = torch.tensor([running_loss / steps], dtype=torch.float64)
        torch_distributed.all_reduce(total)
        return _History(float(total.item()) / world_size)

    candidates = [
        Candidate(
            "keras_dist",
            "fit + kd.DistributeCallback(kd.DataParallel(sync_batch_norm=False))",
            fit_kd,
        ),
        Candidate(
            "keras_dist_sync_bn",
            "fit + kd.DistributeCallback(kd.DataParallel()): global-batch BN",
            fit_sync,
        ),
        Candidate(
            "torch_loop",
            "guide's loop: DistributedSampler + DataLoader, DDP, torch Adam",
            fit_loop,
        ),
    ]
    timings = run_interleaved(
        candidates,
        repeats=args.repeats,
        steps=args.steps,
        skip_steps=args.skip_steps,
        warmup_steps=args.warmup_steps,
        log=None if rank == 0 else (lambda message: None),  # process 0 reports
    )
    devices_used = {
        "keras_dist": processes_agreeing(kd_model),
        "keras_dist_sync_bn": processes_agreeing(sync_model),
        "torch_loop": processes_agreeing(loop_model),
    }
    if rank != 0:
        return
    params = kd_model.count_params()
    report(
        "torch_ddp",
        args,
        devices=world_size,
        global_batch=GLOBAL_BATCH,
        model=f"guide-style convnet on {IMAGE_SHAPE}, {params:,} params, Adam",
        baseline="torch_loop",
        devices_used=devices_used,
        **timings,
    )


if __name__ == "__main__":
    main()
    # Left open, gloo's threads now and then abort the interpreter's shutdown
    # (exit status 134 after a complete run); keras_dist does not close it yet.
    torch_distributed.destroy_process_group()
