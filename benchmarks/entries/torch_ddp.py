"""PyTorch DDP: keras_dist's `fit` against a hand-written DDP training loop.

Both candidates train the same Keras convnet (built from the same seed) on the
same synthetic 28x28x1 images with the same global batch, in the same
processes (2 under `run.py`; any count that divides the batch under `keras-dist
launch`; one CPU device each, gloo), taking turns:

- `keras_dist`: a plain `model.fit(x, y, batch_size=GLOBAL_BATCH, callbacks=[
  kd.DistributeCallback(kd.DataParallel())])`. keras_dist wraps the model in
  `DistributedDataParallel` for the `fit`, gives each process its half of every
  global batch, and keeps the logs global and the replicas equal.
- `torch_loop`: what the keras.io guide "Multi-GPU distributed training with
  PyTorch" does: a `TensorDataset` read through a `DistributedSampler` and a
  `DataLoader` (per-process batch GLOBAL_BATCH / 2), the Keras model wrapped in
  `DistributedDataParallel` once and called directly, `torch.optim.Adam`,
  `torch.nn.CrossEntropyLoss`, `loss.item()` every step.
- `torch_keras_loop`: the same loop with the model's compiled Keras loss and
  its Keras Adam, stepped as the keras.io guide "Writing a training loop from
  scratch in PyTorch" does (`optimizer.apply(gradients, trainable_weights)`):
  Keras' loss and optimizer cost more per step than torch's, which `fit`
  pays too and keras_dist does not replace; against this loop what is left
  is `fit`'s own loop and keras_dist's per-step work.

- `torch_sync_bn_loop`: the anchor for keras_dist's default (global-batch
  BatchNormalization): the loop users write for the same semantics, the same
  convnet in plain `torch.nn` with `SyncBatchNorm` under DDP. torch's
  `nn.SyncBatchNorm` runs on GPUs only (its `batch_norm_stats`,
  `batch_norm_gather_stats_with_counts` and `batch_norm_backward_reduce` have
  no CPU kernels), so on CPU the loop uses `CPUSyncBatchNorm` below: the same
  algorithm with CPU ops (one all-gather of each process' mean, inverse
  standard deviation and count in forward, one all-reduce of the two gradient
  sums in backward); with CUDA tensors it would be `nn.SyncBatchNorm` itself.
- `torch_nn_loop`: that torch.nn convnet with each process' own `BatchNorm2d`,
  so that what synchronizing BatchNorm costs shows on each side
  (`step_ms_added`: `keras_dist_sync_bn - keras_dist` against
  `torch_sync_bn_loop - torch_nn_loop`), apart from what Keras' layers cost
  against torch.nn's (`torch_loop - torch_nn_loop`: the same loop, the Keras
  model against the torch.nn one).

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

import operator
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
    run_interleaved,
)
from benchmarks.mlp import fit_steps  # noqa: E402

PROCESSES = 2  # run.py's count: the entry's name without a suffix
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


class _SyncBatchNormFunction(torch.autograd.Function):
    """torch's `SyncBatchNorm` forward and backward (torch/nn/modules/
    _functions.py) for NCHW CPU tensors: per-process statistics, one
    all-gather of (mean, invstd, count), and one all-reduce of
    (sum_dy, sum_dy_xmu) in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        channels = x.shape[1]
        count = torch.full((1,), x.numel() // channels, dtype=x.dtype)
        var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
        invstd = torch.rsqrt(var + eps)
        local = torch.cat([mean, invstd, count])
        gathered = [torch.empty_like(local) for _ in range(kd.num_processes())]
        torch_distributed.all_gather(gathered, local)
        stats = torch.stack(gathered)
        means, invstds = stats[:, :channels], stats[:, channels : 2 * channels]
        counts = stats[:, 2 * channels :]
        total = counts.sum()
        mean_all = (means * counts).sum(0) / total
        var_each = 1.0 / invstds.square() - eps
        var_all = ((var_each + (means - mean_all).square()) * counts).sum(0) / total
        invstd_all = torch.rsqrt(var_all + eps)
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean_all)
            running_var.mul_(1 - momentum).add_(
                momentum * var_all * total / (total - 1)
            )
        shape = (1, channels, 1, 1)
        normalized = (x - mean_all.view(shape)) * invstd_all.view(shape)
        ctx.save_for_backward(normalized, weight, invstd_all, total)
        return normalized * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, grad):
        normalized, weight, invstd, total = ctx.saved_tensors
        channels = grad.shape[1]
        shape = (1, channels, 1, 1)
        sum_dy = grad.sum(dim=(0, 2, 3))
        sum_dy_xhat = (grad * normalized).sum(dim=(0, 2, 3))
        sums = torch.cat([sum_dy, sum_dy_xhat])
        torch_distributed.all_reduce(sums)
        mean_dy = (sums[:channels] / total).view(shape)
        mean_dy_xhat = (sums[channels:] / total).view(shape)
        grad_input = (weight * invstd).view(shape) * (
            grad - mean_dy - normalized * mean_dy_xhat
        )
        return grad_input, sum_dy_xhat, sum_dy, None, None, None, None


class CPUSyncBatchNorm(torch.nn.BatchNorm2d):
    """`nn.SyncBatchNorm`'s training semantics on CPU (see the module)."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        return _SyncBatchNormFunction.apply(
            x,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            self.momentum,
        )


def torch_convnet(*, synchronized: bool = True) -> torch.nn.Module:
    """`build_model`'s convnet in plain `torch.nn` (NCHW), its BatchNorms
    synchronized over the processes (or, `synchronized=False`, each process'
    own `BatchNorm2d`)."""
    torch.manual_seed(SEED)
    norm = CPUSyncBatchNorm if not torch.cuda.is_available() else None
    if not synchronized:
        norm = torch.nn.BatchNorm2d
    layers: list[torch.nn.Module] = []
    channels = IMAGE_SHAPE[-1]
    for filters, kernel_size, strides in ((16, 3, 1), (32, 5, 2), (48, 5, 2)):
        layers.append(
            torch.nn.Conv2d(
                channels,
                filters,
                kernel_size,
                stride=strides,
                padding=kernel_size // 2,
                bias=False,
            )
        )
        layers.append((norm or torch.nn.BatchNorm2d)(filters, eps=1e-3, momentum=0.01))
        layers.append(torch.nn.ReLU())
        channels = filters
    layers += [
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(channels, 256),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(256, CLASSES),
    ]
    model = torch.nn.Sequential(*layers)
    if norm is None:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def processes_agreeing(model: keras.Model) -> int:
    """How many processes hold the same trainable weights as process 0."""
    flat = torch.cat([v.value.detach().reshape(-1) for v in model.trainable_weights])
    gathered = [torch.empty_like(flat) for _ in range(kd.num_processes())]
    torch_distributed.all_gather(gathered, flat)
    return sum(bool(torch.equal(part, gathered[0])) for part in gathered)


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    world_size, rank = kd.num_processes(), kd.process_id()
    if GLOBAL_BATCH % world_size:
        raise ValueError(
            f"The global batch {GLOBAL_BATCH} must split evenly over the "
            f"processes. Received: {world_size} processes"
        )
    if not torch_distributed.is_initialized():
        # One process: a group of one, so that the loops run as on several
        # (DDP and the collectives of one rank); keras_dist's fit wraps nothing.
        torch_distributed.init_process_group(
            "gloo", store=torch_distributed.HashStore(), rank=0, world_size=1
        )
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

    # -- the hand-written loops: the guide's, and the same with SyncBatchNorm ---
    loss_fn = torch.nn.CrossEntropyLoss()
    x_torch, y_torch = torch.from_numpy(x), torch.from_numpy(y)

    def hand_written_loop(inputs_of: torch.Tensor, train_step: Any) -> Any:
        """A `fit`-like function: `train_step(inputs, targets)` (it returns
        the loss) on each process' batches of `inputs_of`, read through a
        DistributedSampler."""

        def fit_loop(steps: int, callbacks: list) -> _History:
            rows = steps * GLOBAL_BATCH
            dataset = TensorDataset(inputs_of[:rows], y_torch[:rows])
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
                running_loss += train_step(inputs, targets).item()
                for callback in callbacks:
                    callback.on_train_batch_end(step)
            # After the last timed step: the mean loss over processes, as fit
            # logs it.
            total = torch.tensor([running_loss / steps], dtype=torch.float64)
            torch_distributed.all_reduce(total)
            return _History(float(total.item()) / world_size)

        return fit_loop

    def torch_step(module: torch.nn.Module, **call: Any) -> Any:
        """The guide's step for `module` under DDP (it broadcasts rank 0's
        weights): torch's loss and `torch.optim.Adam`."""
        ddp_module = DistributedDataParallel(module)
        optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE, eps=EPSILON)

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> Any:
            loss = loss_fn(ddp_module(inputs, **call), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss

        return train_step

    def keras_objects_step(model: keras.Model) -> Any:
        """The same step with the model's compiled Keras loss and Keras
        optimizer, stepped as the keras.io guide "Writing a training loop from
        scratch in PyTorch" does (`optimizer.apply(gradients, weights)`): what
        is left between it and `keras_dist` is `fit`'s own loop and
        keras_dist's per-step work, not Keras' loss and optimizer."""
        ddp_module = DistributedDataParallel(model)
        keras_loss, optimizer = model.loss, model.optimizer

        def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> Any:
            loss = keras_loss(targets, ddp_module(inputs, training=True))
            model.zero_grad()
            loss.backward()
            weights = model.trainable_weights
            with torch.no_grad():
                optimizer.apply([w.value.grad for w in weights], weights)
            return loss

        return train_step

    loop_model = build_model()
    fit_loop = hand_written_loop(x_torch, torch_step(loop_model, training=True))
    keras_loop_model = build_model()
    fit_keras_loop = hand_written_loop(x_torch, keras_objects_step(keras_loop_model))
    x_nchw = x_torch.permute(0, 3, 1, 2).contiguous()
    fit_sync_loop = hand_written_loop(x_nchw, torch_step(torch_convnet()))
    fit_nn_loop = hand_written_loop(
        x_nchw, torch_step(torch_convnet(synchronized=False))
    )

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
        Candidate(
            "torch_keras_loop",
            "the same loop with the model's Keras loss and Keras Adam "
            "(optimizer.apply, as the from-scratch guide)",
            fit_keras_loop,
        ),
        Candidate(
            "torch_sync_bn_loop",
            "the same convnet in torch.nn, SyncBatchNorm (CPU: same algorithm), DDP",
            fit_sync_loop,
        ),
        Candidate(
            "torch_nn_loop",
            "the same convnet in torch.nn, each process' own BatchNorm2d, DDP",
            fit_nn_loop,
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
        "torch_keras_loop": processes_agreeing(keras_loop_model),
    }
    # keras_dist's default against the loop with the same semantics, pair by
    # pair (each repeat times every candidate in turn).
    by_name = {c["name"]: c["repeats"] for c in timings["candidates"]}

    def per_pair(ours: str, theirs: str, combine: Any) -> dict[str, Any]:
        each = sorted(
            combine(a["median_step_s"], b["median_step_s"])
            for a, b in zip(by_name[ours], by_name[theirs], strict=True)
        )
        return {"each": each, "median": each[len(each) // 2]}

    anchor = per_pair("keras_dist_sync_bn", "torch_sync_bn_loop", operator.truediv)
    # keras_dist's fit against the loops, pair by pair: the guide's (torch's
    # loss and Adam) and the same with the model's Keras loss and optimizer.
    against_loops = {
        f"keras_dist / {loop}": per_pair("keras_dist", loop, operator.truediv)
        for loop in ("torch_loop", "torch_keras_loop")
    }
    # What synchronizing BatchNorm costs each way (ms a step, pair by pair), and
    # what Keras' layers cost against torch.nn with per-process statistics.
    added_ms = {
        f"{with_it} - {without}": per_pair(with_it, without, lambda a, b: 1e3 * (a - b))
        for with_it, without in (
            ("keras_dist_sync_bn", "keras_dist"),
            ("torch_sync_bn_loop", "torch_nn_loop"),
            ("torch_loop", "torch_nn_loop"),
        )
    }
    if rank != 0:
        return
    params = kd_model.count_params()
    report(
        "torch_ddp" if world_size == PROCESSES else f"torch_ddp_{world_size}",
        args,
        devices=world_size,
        global_batch=GLOBAL_BATCH,
        model=f"guide-style convnet on {IMAGE_SHAPE}, {params:,} params, Adam",
        baseline="torch_loop",
        devices_used=devices_used,
        sync_bn_step_time_ratio={
            "keras_dist_sync_bn / torch_sync_bn_loop": anchor["each"],
            "median": anchor["median"],
        },
        step_ms_added=added_ms,
        step_time_ratio_per_pair=against_loops,
        **timings,
    )


if __name__ == "__main__":
    main()
    # Left open, gloo's threads now and then abort the interpreter's shutdown
    # (exit status 134 after a complete run); keras_dist does not close it yet.
    torch_distributed.destroy_process_group()
