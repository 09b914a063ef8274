"""Keras' `gradient_accumulation_steps` under `kd.DataParallel`, and the
references it must equal: plain Keras on one device, once with the same
accumulation and once with one batch ACCUMULATION times larger.

Imported by tests/test_gradient_accumulation.py (JAX and TensorFlow, one
process) and run as one rank of a PyTorch job by `tests.multiprocess.run_job`:
Usage: python gradient_accumulation_worker.py OUTPUT_JSON
On PyTorch every gradient all-reduce is counted: with DDP
(`KERAS_DIST_TORCH_GRADIENT_SYNC=ddp`) through a communication hook registered
on each `DistributedDataParallel` made, else (the gradients averaged after
backward) each `all_reduce` of a float32 tensor (the metric states' sums are
float64).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import keras
import numpy as np
import worker_seed

import keras_dist as kd

ROWS, MICRO_BATCH, ACCUMULATION, EPOCHS = 64, 16, 2, 2
MICRO_STEPS = EPOCHS * ROWS // MICRO_BATCH  # 8 micro-steps, 4 weight updates

OPTIMIZERS: dict[str, Callable[..., keras.optimizers.Optimizer]] = {
    "sgd_momentum": lambda **options: keras.optimizers.SGD(
        0.1, momentum=0.9, **options
    ),
    "adam": lambda **options: keras.optimizers.Adam(0.01, **options),
}


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = np.stack([x.sum(axis=1), x[:, 0] * x[:, 1]], axis=1).astype("float32")
    return x, y


def train(optimizer: str, *, accumulate: bool, callbacks: tuple = ()) -> keras.Model:
    """Micro-batches of MICRO_BATCH rows with `gradient_accumulation_steps`,
    or (`accumulate=False`) batches ACCUMULATION times larger without it."""
    worker_seed.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ],
        name="accumulating" if accumulate else "big_batch",
    )
    options = {"gradient_accumulation_steps": ACCUMULATION} if accumulate else {}
    model.compile(optimizer=OPTIMIZERS[optimizer](**options), loss="mse")
    x, y = data()
    batch_size = MICRO_BATCH if accumulate else MICRO_BATCH * ACCUMULATION
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model


def weights(model: keras.Model) -> list[list[float]]:
    return [np.asarray(w, "float64").ravel().tolist() for w in model.get_weights()]


def run(
    distribution: Callable[[], kd.Distribution],
    counted: Callable[[], int] | None = None,
) -> dict:
    """Per optimizer: the weights trained under `distribution()` and those of
    both one-device references, the optimizers' step counters and (with
    `counted`, the gradient all-reduces so far) the distributed fit's
    gradient all-reduces. In a job, Keras 3.16 wraps the references in its own
    DDP (their data is the same on every process, so they still train as on
    one device): they train after the count, which is keras_dist's alone."""
    result = {}
    all_reduces = []
    for name in OPTIMIZERS:
        before = counted() if counted else 0
        model = train(
            name, accumulate=True, callbacks=(kd.DistributeCallback(distribution()),)
        )
        if counted:
            all_reduces.append(counted() - before)
        plain = train(name, accumulate=True)
        big = train(name, accumulate=False)
        result[name] = {
            "distributed": weights(model),
            "plain_accumulation": weights(plain),
            "big_batch": weights(big),
            "iterations": int(np.asarray(model.optimizer.iterations)),
            "big_batch_iterations": int(np.asarray(big.optimizer.iterations)),
        }
    if counted is not None:
        result["all_reduces"] = all_reduces
    return result


def count_gradient_all_reduces() -> Callable[[], int]:
    """How many gradient all-reduces ran from now on (see the module)."""
    import torch
    import torch.distributed as torch_distributed

    from keras_dist.backends.torch.process_group import gradient_sync

    if gradient_sync(torch.device("cpu")) != "ddp":
        calls = [0]
        all_reduce = torch_distributed.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            calls[0] += tensor.dtype == torch.float32
            return all_reduce(tensor, *args, **kwargs)

        torch_distributed.all_reduce = counting_all_reduce
        return lambda: calls[0]
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    # One counter per DistributedDataParallel made: how many times it
    # all-reduced a gradient bucket (a hook doing what DDP's reducer does).
    counters: list[list[int]] = []
    original = DistributedDataParallel.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        counter = [0]
        counters.append(counter)

        def counting(state, bucket):
            counter[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        self.register_comm_hook(None, counting)

    DistributedDataParallel.__init__ = __init__
    return lambda: sum(counter[0] for counter in counters)


def main() -> None:
    kd.initialize()
    result = run(kd.DataParallel, count_gradient_all_reduces())
    result["processes"] = kd.num_processes()
    with open(sys.argv[-1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
