"""PyTorch DDP on the shared MLP: keras_dist's `fit` against a hand-written loop.

The model and data of the JAX and TensorFlow data-parallel entries
(`benchmarks/mlp.py`: MLP 256-512-512-10, Adam, global batch 512), in as many
processes as the launcher starts (one CPU device each, gloo), taking turns:

- `keras_dist`: `model.fit(x, y, batch_size=512, callbacks=[
  kd.DistributeCallback(kd.DataParallel())])`: each process its share of
  every global batch, the gradients averaged in one all-reduce after backward
  (keras_dist's choice on CPU; `KERAS_DIST_TORCH_GRADIENT_SYNC=ddp` runs DDP
  instead, its choice on CUDA), global logs (the loss and accuracy states
  all-reduced).
- `torch_loop`: the keras.io guide's loop on the same Keras model (the same
  seed): a `DistributedSampler` and a `DataLoader` (per-process batch 512 / N),
  the model wrapped in `DistributedDataParallel` once and called directly,
  `torch.optim.Adam` with Keras' learning rate and epsilon,
  `torch.nn.CrossEntropyLoss`, `loss.item()` every step (the baseline).
- `keras_dist_loss_only`: the same `fit` of the model compiled with the loss
  only, no accuracy metric: the work the loop does (it computes no accuracy).
- on one process also `plain_keras`: the same `fit` without keras_dist, so
  that the two parts of keras_dist's gap stay visible (Keras' own per-step
  work: `plain_keras` / `torch_loop`; keras_dist's: `keras_dist` /
  `plain_keras`). With one process the loop has no DDP and keras_dist wraps
  nothing.
- on several processes, where the installed Keras wraps a model in DDP itself
  once `torch.distributed` is initialized (Keras 3.16), also `keras_ddp`:
  Keras' own multi-process `fit`, each process fitting its share of every
  global batch (batch 512 / N) with no distribution set: the same update with
  Keras' own per-step work on several processes, so that keras_dist's part
  of the gap is `keras_dist` / `keras_ddp` there.

With `KERAS_DIST_BENCH_BREAKDOWN=1` (several processes) also, to see where the
multi-process step's time goes: `keras_dist_local_logs`, the same fit with the
per-step sum of the metric states skipped (each step's logs are then this
process' own; the epoch's logs are still summed): what global step logs cost;
`plain_keras_own_rows`, plain Keras' `fit` of this process' rows alone (batch
512 / N, no communication), and `torch_loop_own_rows`, the loop on them with no
DDP: each side's per-step work at the per-process batch. With
`KERAS_DIST_BENCH_JIT=1` as well, also `plain_keras_jit_own_rows` and
`torch_loop_jit_own_rows`: the same two compiled (`jit_compile=True`;
`torch.compile` of the model). And `torch_loop_after_backward` (with
`KERAS_DIST_BENCH_JIT=1` also `torch_loop_jit_after_backward`): the guide's
loop without DDP, its gradients averaged in one all-reduce after backward, as
keras_dist's step averages them on CPU; and `keras_dist_ddp` (with
`KERAS_DIST_BENCH_JIT=1` also `keras_dist_jit_ddp`): keras_dist's fit with its
gradients averaged by DDP, as on CUDA.

With `KERAS_DIST_BENCH_JIT=1` also `keras_dist_jit` (and on one process
`plain_keras_jit`): the same fits of a model compiled with `jit_compile=True`,
whose step Keras' torch trainer compiles with `torch.compile` (the compile
happens in the warm-up), and `torch_loop_jit`: the hand loop with its DDP
module compiled, `torch.compile(DistributedDataParallel(model))` as torch's
DDP documentation does (dynamo's DDPOptimizer splits the graph at the gradient
buckets), torch Adam and the loss eager. Before the timing, each compiled
keras_dist (or plain Keras) model's third step runs through
`torch._dynamo.explain`: its graphs and graph breaks, with the frames they
come from, are printed and written to the JSON (`dynamo_explain`), with the
number of breaks TorchDynamo could not resume after (`not_resumed`: a frame
left eager).

The keras_dist fit also computes the accuracy metric the model was compiled
with; the loop does not (it is what users write). Each process uses one torch
thread. `benchmarks/scaling.py` runs this entry for 1, 2 and 4 processes
beside the JAX and TensorFlow entries for 2, 4 and 8 devices.

```shell
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/entries/torch_ddp_mlp.py --repeats 3
```
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_dist as kd  # noqa: E402  (joins the job before anything else)

kd.initialize()

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
from benchmarks.mlp import (  # noqa: E402
    GLOBAL_BATCH,
    build_model,
    describe,
    fit_steps,
    synthetic_data,
)
from benchmarks.torch_compile_report import (  # noqa: E402
    explain_fit_step,
    print_report,
)
from keras_dist.keras_compat.torch_trainer import keras_wraps_in_ddp  # noqa: E402


class _History:
    """What the harness reads from a `fit`'s return value."""

    def __init__(self, loss: float):
        self.history = {"loss": [loss]}


def _torch_adam(model: Any) -> torch.optim.Adam:
    """torch's Adam on `model`'s parameters with its Keras optimizer's
    learning rate and epsilon (what the hand loops train with)."""
    return torch.optim.Adam(
        model.parameters(),
        lr=float(model.optimizer.learning_rate),
        eps=model.optimizer.epsilon,
    )


def _own_rows(x: Any, y: Any, world_size: int, rank: int) -> tuple[Any, Any]:
    """This process' rows of each global batch, in order, as keras_dist
    gives them to it."""
    share = GLOBAL_BATCH // world_size
    rows = len(x) // GLOBAL_BATCH * GLOBAL_BATCH
    x_own = x[:rows].reshape(-1, world_size, share, x.shape[-1])[:, rank]
    y_own = y[:rows].reshape(-1, world_size, share)[:, rank]
    return x_own.reshape(-1, x.shape[-1]), y_own.reshape(-1)


def _keras_dist_callbacks() -> list:
    return [kd.DistributeCallback(kd.DataParallel())]


def _breakdown(
    x: Any, y: Any, world_size: int, rank: int, loop: Callable[..., Any]
) -> list[Candidate]:
    """The candidates of `KERAS_DIST_BENCH_BREAKDOWN=1` (see the module)."""
    from keras_dist.backends.torch import metric_sync  # noqa: PLC0415

    summed_fit = fit_steps(build_model(), x, y, _keras_dist_callbacks)
    original_start = metric_sync.MetricSync.start

    def start_without_sum(sync: Any) -> Any:
        return metric_sync.PendingSum(sync._model, sync._current_layout(), _no_wait)

    def local_logs_fit(steps: int, callbacks: list) -> Any:
        metric_sync.MetricSync.start = start_without_sum
        try:
            return summed_fit(steps, callbacks)
        finally:
            metric_sync.MetricSync.start = original_start

    share = GLOBAL_BATCH // world_size
    x_own, y_own = _own_rows(x, y, world_size, rank)
    alone = build_model()
    candidates = [
        Candidate(
            "keras_dist_local_logs",
            "keras_dist's fit, the per-step metric sum skipped (step logs local)",
            local_logs_fit,
        ),
        Candidate(
            "plain_keras_own_rows",
            "plain Keras' fit of this process' rows alone, no communication",
            fit_steps(build_model(), x_own, y_own, batch_size=share),
        ),
        Candidate(
            "torch_loop_own_rows",
            "the loop on this process' rows alone, no DDP",
            loop(alone, _torch_adam(alone), rows_of=(x_own, y_own)),
        ),
    ]
    if os.environ.get("KERAS_DIST_BENCH_JIT") == "1":
        alone_jit = build_model()
        candidates += [
            Candidate(
                "plain_keras_jit_own_rows",
                "plain Keras' fit of this process' rows alone, jit_compile=True",
                fit_steps(
                    build_model(jit_compile=True), x_own, y_own, batch_size=share
                ),
            ),
            Candidate(
                "torch_loop_jit_own_rows",
                "the loop on this process' rows alone, its model torch.compile'd",
                loop(
                    torch.compile(alone_jit),
                    _torch_adam(alone_jit),
                    rows_of=(x_own, y_own),
                ),
            ),
        ]
    return candidates


def _keras_dist_under_ddp(x: Any, y: Any, *, jit: bool) -> list[Candidate]:
    """keras_dist's fit with its gradients averaged by DDP, its way on CUDA
    (`KERAS_DIST_TORCH_GRADIENT_SYNC=ddp` for the fit), eager and with
    `KERAS_DIST_BENCH_JIT=1` also compiled."""

    def under_ddp(fit: Callable[..., Any]) -> Callable[..., Any]:
        def run(steps: int, callbacks: list) -> Any:
            os.environ["KERAS_DIST_TORCH_GRADIENT_SYNC"] = "ddp"
            try:
                return fit(steps, callbacks)
            finally:
                del os.environ["KERAS_DIST_TORCH_GRADIENT_SYNC"]

        return run

    candidates = [
        Candidate(
            "keras_dist_ddp",
            "keras_dist's fit, the gradients averaged by DDP",
            under_ddp(fit_steps(build_model(), x, y, _keras_dist_callbacks)),
        )
    ]
    if jit:
        model = build_model(jit_compile=True)
        candidates.append(
            Candidate(
                "keras_dist_jit_ddp",
                "keras_dist's compiled fit, the gradients averaged by DDP",
                under_ddp(fit_steps(model, x, y, _keras_dist_callbacks)),
            )
        )
    return candidates


def _loops_averaging_after_backward(
    loop: Callable[..., Any], world_size: int, *, jit: bool
) -> list[Candidate]:
    """The guide's loop without DDP, its gradients averaged in one all-reduce
    after backward, as keras_dist's step does on CPU (eager, and with
    `KERAS_DIST_BENCH_JIT=1` also its model compiled)."""
    from torch._utils import (  # noqa: PLC0415
        _flatten_dense_tensors,
        _unflatten_dense_tensors,
    )

    def candidate(name: str, compiled: bool) -> Candidate:
        model = build_model()
        parameters = list(model.parameters())

        def average() -> None:
            gradients = [p.grad for p in parameters]
            flat = _flatten_dense_tensors(gradients)
            flat /= world_size
            torch_distributed.all_reduce(flat)
            torch._foreach_copy_(gradients, _unflatten_dense_tensors(flat, gradients))

        forward = torch.compile(model) if compiled else model
        return Candidate(
            name,
            "the loop without DDP, gradients averaged in one all-reduce after "
            "backward" + (", its model torch.compile'd" if compiled else ""),
            loop(forward, _torch_adam(model), average=average),
        )

    candidates = [candidate("torch_loop_after_backward", False)]
    if jit:
        candidates.append(candidate("torch_loop_jit_after_backward", True))
    return candidates


def _no_wait() -> None:
    return None


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    world_size, rank = kd.num_processes(), kd.process_id()
    if GLOBAL_BATCH % world_size:
        raise ValueError(
            f"The global batch {GLOBAL_BATCH} must split evenly over the "
            f"processes. Received: {world_size} processes"
        )
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    kd_model = build_model()
    fit_kd = fit_steps(kd_model, x, y, _keras_dist_callbacks)

    loop_model = build_model()
    forward = DistributedDataParallel(loop_model) if world_size > 1 else loop_model
    optimizer = _torch_adam(loop_model)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_torch, y_torch = torch.from_numpy(x), torch.from_numpy(y).long()

    def loop(
        forward: Any,
        optimizer: Any,
        rows_of: tuple | None = None,
        average: Callable[[], None] | None = None,
    ) -> Callable[[int, list], _History]:
        return lambda steps, callbacks: fit_loop(
            steps, callbacks, forward, optimizer, rows_of, average
        )

    def fit_loop(
        steps: int,
        callbacks: list,
        forward: Any = forward,
        optimizer: Any = optimizer,
        rows_of: tuple | None = None,
        average: Callable[[], None] | None = None,
    ) -> _History:
        share = GLOBAL_BATCH // world_size
        if rows_of is None:
            rows = steps * GLOBAL_BATCH
            dataset = TensorDataset(x_torch[:rows], y_torch[:rows])
            sampler = DistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=False
            )
        else:  # this process' rows alone, in order
            own_x, own_y = (torch.from_numpy(part) for part in rows_of)
            own_y = own_y.long()
            dataset = TensorDataset(own_x[: steps * share], own_y[: steps * share])
            sampler = None
        loader = DataLoader(dataset, sampler=sampler, batch_size=share)
        for callback in callbacks:
            callback.on_train_begin()
        running_loss = 0.0
        for step, (inputs, targets) in enumerate(loader):
            loss = loss_fn(forward(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            if average is not None:
                average()
            optimizer.step()
            running_loss += loss.item()
            for callback in callbacks:
                callback.on_train_batch_end(step)
        total = torch.tensor([running_loss / steps], dtype=torch.float64)
        if world_size > 1 and rows_of is None:
            torch_distributed.all_reduce(total)
            total /= world_size
        return _History(float(total.item()))

    candidates = [
        Candidate(
            "keras_dist", "fit + kd.DistributeCallback(kd.DataParallel())", fit_kd
        ),
        Candidate(
            "torch_loop",
            "guide's loop: DistributedSampler + DataLoader, DDP, torch Adam",
            fit_loop,
        ),
        # The loop's work: the loss, no accuracy metric.
        Candidate(
            "keras_dist_loss_only",
            "keras_dist's fit of the model compiled with the loss only",
            fit_steps(build_model(metrics=()), x, y, _keras_dist_callbacks),
        ),
    ]
    if world_size == 1:
        plain_model = build_model()
        candidates.append(
            Candidate("plain_keras", "fit, no keras_dist", fit_steps(plain_model, x, y))
        )
        candidates.append(
            Candidate(
                "plain_keras_loss_only",
                "fit, no keras_dist, the loss only",
                fit_steps(build_model(metrics=()), x, y),
            )
        )
    explained = {}
    if os.environ.get("KERAS_DIST_BENCH_JIT") == "1":
        log = print if rank == 0 else (lambda *_: None)
        explained["keras_dist_jit"] = explain_fit_step(
            fit_steps(build_model(jit_compile=True), x, y, _keras_dist_callbacks)
        )
        print_report("keras_dist_jit", explained["keras_dist_jit"], log)
        candidates.append(
            Candidate(
                "keras_dist_jit",
                "keras_dist's fit, compiled with jit_compile=True",
                fit_steps(build_model(jit_compile=True), x, y, _keras_dist_callbacks),
            )
        )
        jit_model = build_model()
        jit_forward = torch.compile(
            DistributedDataParallel(jit_model) if world_size > 1 else jit_model
        )
        jit_optimizer = _torch_adam(jit_model)
        candidates.append(
            Candidate(
                "torch_loop_jit",
                "the guide's loop, its DDP module torch.compile'd",
                loop(jit_forward, jit_optimizer),
            )
        )
        if world_size == 1:
            explained["plain_keras_jit"] = explain_fit_step(
                fit_steps(build_model(jit_compile=True), x, y)
            )
            print_report("plain_keras_jit", explained["plain_keras_jit"], log)
            candidates.append(
                Candidate(
                    "plain_keras_jit",
                    "fit, no keras_dist, jit_compile=True",
                    fit_steps(build_model(jit_compile=True), x, y),
                )
            )
    if world_size > 1 and os.environ.get("KERAS_DIST_BENCH_BREAKDOWN") == "1":
        candidates += _breakdown(x, y, world_size, rank, loop)
        candidates += _keras_dist_under_ddp(
            x, y, jit=os.environ.get("KERAS_DIST_BENCH_JIT") == "1"
        )
        candidates += _loops_averaging_after_backward(
            loop, world_size, jit=os.environ.get("KERAS_DIST_BENCH_JIT") == "1"
        )
    if world_size > 1 and keras_wraps_in_ddp():
        x_own, y_own = _own_rows(x, y, world_size, rank)
        candidates.append(
            Candidate(
                "keras_ddp",
                "Keras' own DDP: fit on this process' rows, no distribution",
                fit_steps(
                    build_model(), x_own, y_own, batch_size=GLOBAL_BATCH // world_size
                ),
            )
        )
    timings = run_interleaved(
        candidates,
        repeats=args.repeats,
        steps=args.steps,
        skip_steps=args.skip_steps,
        warmup_steps=args.warmup_steps,
        log=None if rank == 0 else (lambda message: None),  # process 0 reports
    )
    if rank != 0:
        return
    report(
        "torch_ddp_mlp" if world_size == 2 else f"torch_ddp_mlp_{world_size}",
        args,
        devices=world_size,
        global_batch=GLOBAL_BATCH,
        model=describe(kd_model),
        baseline="torch_loop",
        devices_used={},
        dynamo_explain=explained,
        **timings,
    )


if __name__ == "__main__":
    main()
    if torch_distributed.is_initialized():
        # Left open, gloo's threads now and then abort the interpreter's shutdown.
        torch_distributed.destroy_process_group()
