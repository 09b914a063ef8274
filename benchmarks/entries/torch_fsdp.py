"""PyTorch FSDP: keras_dist's `kd.FSDP` against a hand-written `fully_shard` loop.

Both candidates train the same MLP (256-512-512-10, ReLU, the same initial
weights) on the same synthetic data with the same global batch, in the same 2
processes (one CPU device and one torch thread each, gloo), taking turns:

- `keras_dist_fsdp`: a Keras model, `model.fit(x, y, batch_size=GLOBAL_BATCH,
  callbacks=[kd.DistributeCallback(kd.FSDP(min_size=MIN_SIZE))])`. While the
  fit runs, each variable of at least `MIN_SIZE` elements and its Adam
  moments are DTensors split over the 2 processes (keras_dist's DTensor path,
  `keras_dist/backends/torch/dtensor.py`); each process computes on its half
  of every global batch.
- `fully_shard`: the native way, FSDP2: a plain `torch.nn.Sequential` of
  `Linear` and `ReLU` with the Keras model's initial weights, each `Linear`
  and then the root wrapped by `torch.distributed.fsdp.fully_shard`,
  `torch.optim.Adam` (same learning rate and epsilon),
  `torch.nn.CrossEntropyLoss`, each process feeding its half of every global
  batch, `loss.item()` every step. It calls the same `StepTimer` hooks itself.
  FSDP2's default, `reshard_after_forward=True`: each layer's gathered
  weights are freed after its forward and all-gathered again in its backward,
  as `kd.FSDP` does. The baseline (`--check` compares against it).
- `fully_shard_no_reshard`: the same loop with
  `fully_shard(..., reshard_after_forward=False)`: the gathered weights stay
  until the backward (one all-gather per layer and step instead of two, more
  memory). The result's `ratio_against_no_reshard` is the median over repeats
  of `keras_dist_fsdp` / this candidate, each pair timed back to back.

Memory: in a short fit of each (outside the timing), the bytes each process
holds of the weights and the optimizer's state while training: local shards of
DTensors, whole plain tensors. `keras_dist_dp` (`kd.DataParallel()`, the same
Keras model replicated) is the replicated figure.

Run it through the runner (which starts it under `keras-dist launch`), or:

```shell
KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 \
    benchmarks/entries/torch_fsdp.py --repeats 3
```
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_dist as kd  # noqa: E402  (joins the job before anything else)

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as torch_distributed  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    Candidate,
    StepTimer,
    compare_memory,
    entry_arguments,
    report,
    require_processes,
    run_interleaved,
)
from benchmarks.mlp import (  # noqa: E402
    CLASSES,
    FEATURES,
    GLOBAL_BATCH,
    HIDDEN,
    SEED,
    fit_steps,
)

PROCESSES = 2
LEARNING_RATE = 1e-3
EPSILON = 1e-7
# Splits every kernel and the 512-element biases; the 10-element head bias
# (and Adam's scalars) stay replicated.
MIN_SIZE = 512
MEMORY_STEPS = 3


def build_model() -> keras.Model:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden_1"),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden_2"),
            keras.layers.Dense(CLASSES, name="logits"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE, epsilon=EPSILON),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def torch_twin(model: keras.Model) -> torch.nn.Sequential:
    """A plain torch MLP with `model`'s weights (Keras kernels are (in, out))."""
    modules: list[torch.nn.Module] = []
    for index, layer in enumerate(model.layers):
        kernel, bias = (keras.ops.convert_to_numpy(w) for w in layer.weights)
        linear = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
            linear.bias.copy_(torch.from_numpy(bias))
        modules.append(linear)
        if index < len(model.layers) - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)


def synthetic_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(rows,)).astype("int64")
    return x, y


def local_bytes(tensor: torch.Tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


class HeldBytes(keras.callbacks.Callback):
    """Bytes of the weights and optimizer variables this process holds, read
    when the first training step ends (keras_dist gathers them back into full
    tensors when the fit ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.record: dict[str, Any] | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.record is not None:
            return
        held, total, replicated = 0, 0, []
        for variable in [*self.model.weights, *self.model.optimizer.variables]:
            value = variable.value
            held += local_bytes(value)
            total += int(np.prod(variable.shape)) * value.element_size()
            if not isinstance(value, DTensor) or all(
                p.is_replicate() for p in value.placements
            ):
                replicated.append(f"{variable.path} {tuple(variable.shape)}")
        self.record = {
            "held_bytes": held,
            "total_bytes": total,
            "replicated": replicated,
        }


def processes_agreeing(model: keras.Model) -> int:
    """How many processes hold the same trainable weights as process 0 (after
    the fit keras_dist has gathered them back into full tensors)."""
    flat = torch.cat([v.value.detach().reshape(-1) for v in model.trainable_weights])
    gathered = [torch.empty_like(flat) for _ in range(kd.num_processes())]
    torch_distributed.all_gather(gathered, flat)
    return sum(bool(torch.equal(part, gathered[0])) for part in gathered)


def processes_holding_shards(module: torch.nn.Module) -> int:
    """How many processes hold a non-empty part of `module`'s first weight."""
    first = next(module.parameters())
    mine = torch.tensor([int(local_bytes(first) > 0)], dtype=torch.int64)
    torch_distributed.all_reduce(mine)
    return int(mine.item())


def paired_ratio(timings: dict[str, Any], name: str, other: str) -> float:
    """The median over repeats of `name`'s median step / `other`'s (each pair
    timed back to back), as the runner computes ratios against the baseline."""
    repeats = {c["name"]: c["repeats"] for c in timings["candidates"]}
    return statistics.median(
        mine["median_step_s"] / theirs["median_step_s"]
        for mine, theirs in zip(repeats[name], repeats[other], strict=True)
    )


class _History:
    """What the harness reads from a `fit`'s return value."""

    def __init__(self, loss: float):
        self.history = {"loss": [loss]}


def fully_shard_loop(
    x: np.ndarray, y: np.ndarray, mesh: Any, *, reshard: bool
) -> tuple[torch.nn.Module, Any, Any]:
    """The hand-written FSDP2 loop: its module, its fit (the harness' `fit`
    signature) and a reader of the bytes it holds."""
    world_size, rank = kd.num_processes(), kd.process_id()
    loop_model = torch_twin(build_model())
    for module in loop_model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(loop_model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(loop_model.parameters(), lr=LEARNING_RATE, eps=EPSILON)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = GLOBAL_BATCH // world_size
    x_torch, y_torch = torch.from_numpy(x), torch.from_numpy(y)

    def fit_loop(steps: int, callbacks: list) -> _History:
        for callback in callbacks:
            callback.on_train_begin()
        running_loss = 0.0
        for step in range(steps):
            start = step * GLOBAL_BATCH + rank * local
            inputs, targets = (
                x_torch[start : start + local],
                y_torch[start : start + local],
            )
            loss = loss_fn(loop_model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            for callback in callbacks:
                callback.on_train_batch_end(step)
        total = torch.tensor([running_loss / steps], dtype=torch.float64)
        torch_distributed.all_reduce(total)
        return _History(float(total.item()) / world_size)

    def loop_held_bytes() -> dict[str, Any]:
        tensors = list(loop_model.parameters()) + [
            value
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        return {
            "held_bytes": sum(local_bytes(t) for t in tensors),
            "total_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "replicated": [
                f"{name} {tuple(p.shape)}"
                for name, p in loop_model.named_parameters()
                if not isinstance(p, DTensor)
                or all(placement.is_replicate() for placement in p.placements)
            ],
        }

    return loop_model, fit_loop, loop_held_bytes


def main() -> None:
    args = entry_arguments(__doc__.splitlines()[0])
    require_processes(PROCESSES)
    torch.set_num_threads(1)
    world_size, rank = kd.num_processes(), kd.process_id()
    x, y = synthetic_data(max(args.steps, args.warmup_steps) * GLOBAL_BATCH)

    # -- keras_dist ---------------------------------------------------------------
    fsdp = kd.FSDP(min_size=MIN_SIZE)
    fsdp_model = build_model()
    fit_fsdp = fit_steps(fsdp_model, x, y, lambda: [kd.DistributeCallback(fsdp)])
    dp_model = build_model()
    fit_dp = fit_steps(
        dp_model, x, y, lambda: [kd.DistributeCallback(kd.DataParallel())]
    )

    # -- the hand-written fully_shard loops ----------------------------------------
    mesh = init_device_mesh("cpu", (world_size,))
    loop_model, fit_loop, loop_held_bytes = fully_shard_loop(x, y, mesh, reshard=True)
    _, fit_loop_no_reshard, _ = fully_shard_loop(x, y, mesh, reshard=False)

    # -- memory, outside the timing ------------------------------------------------
    memory: dict[str, dict[str, Any]] = {}
    for name, fit in (("keras_dist_fsdp", fit_fsdp), ("keras_dist_dp", fit_dp)):
        probe = HeldBytes()
        fit(MEMORY_STEPS, [probe, StepTimer()])
        memory[name] = probe.record
    fit_loop(MEMORY_STEPS, [])
    memory["fully_shard"] = loop_held_bytes()
    fit_loop_no_reshard(MEMORY_STEPS, [])  # the same steps as every candidate
    for record in memory.values():
        # The process that holds the most decides what fits.
        mine = torch.tensor([record["held_bytes"]], dtype=torch.int64)
        torch_distributed.all_reduce(mine, op=torch_distributed.ReduceOp.MAX)
        record["max_device_bytes"] = int(mine.item())
    compare_memory(memory, world_size)

    candidates = [
        Candidate(
            "keras_dist_fsdp",
            f"fit + kd.DistributeCallback(kd.FSDP(min_size={MIN_SIZE}))",
            fit_fsdp,
        ),
        Candidate(
            "fully_shard",
            "torch MLP, fully_shard per Linear and root, torch Adam, own loop",
            fit_loop,
        ),
        Candidate(
            "fully_shard_no_reshard",
            "the same with fully_shard(reshard_after_forward=False)",
            fit_loop_no_reshard,
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
        "keras_dist_fsdp": processes_agreeing(fsdp_model),
        "fully_shard": processes_holding_shards(loop_model),
    }
    if rank != 0:
        return
    against_no_reshard = paired_ratio(
        timings, "keras_dist_fsdp", "fully_shard_no_reshard"
    )
    print(
        "keras_dist_fsdp / fully_shard_no_reshard median step-time ratio "
        f"{against_no_reshard:.3f}",
        file=sys.stderr,
        flush=True,
    )
    params = fsdp_model.count_params()
    report(
        "torch_fsdp",
        args,
        devices=world_size,
        global_batch=GLOBAL_BATCH,
        model=f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, {params:,} params, Adam",
        baseline="fully_shard",
        memory=memory,
        devices_used=devices_used,
        ratio_against_no_reshard=against_no_reshard,
        **timings,
    )


if __name__ == "__main__":
    main()
    # As in torch_ddp: left open, gloo's threads may abort the shutdown.
    torch_distributed.destroy_process_group()
