"""One BatchNormalization layer's training step on PyTorch: keras_dist's ways
against Keras' own and torch.nn's.

Times the forward and backward of one Keras `BatchNormalization` layer in
training mode (`layer(x, training=True)`, then the gradient of a fixed
cotangent) on the channels-last activations of the `torch_ddp` entry's
convnet (per process: 64 rows of 28x28x16, 14x14x32, 7x7x48), one torch thread,
interleaved, for:

- `keras`: the layer as Keras runs it (per-process statistics).
- `global_moments`: keras_dist's global-batch statistics
  (`backends/torch/global_moments.global_moments`) under Keras' own
  normalization: what keras_dist ran before `global_batch_norm`.
- `global_batch_norm`: the whole normalization in one autograd Function
  (`global_batch_norm`), what keras_dist runs now.
- `torch_nn`: `torch.nn.BatchNorm2d` on the same values laid out NCHW
  (per-process statistics, torch's fused kernels): the native layer.

The collectives run on a one-process gloo group, so the figures are each way's
work, not the wait for other processes (the `torch_ddp` entry has those).
Prints one JSON object: the median milliseconds of each per shape, and
`global_batch_norm / global_moments`.

```shell
PYTHONPATH=. python benchmarks/torch_batch_norm.py --repeats 200
```
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "torch"

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import keras  # noqa: E402
import torch  # noqa: E402
import torch.distributed as torch_distributed  # noqa: E402

from keras_dist.backends.torch.global_moments import (  # noqa: E402
    global_batch_norm,
    global_moments,
)
from keras_dist.common.batch_norm import GlobalBatchNorm  # noqa: E402
from keras_dist.keras_compat.batch_norm import replace_moments  # noqa: E402

SHAPES = ((64, 28, 28, 16), (64, 14, 14, 32), (64, 7, 7, 48))


def layer_step(shape: tuple[int, ...], way: str) -> Callable[[], None]:
    """One forward and backward of a BatchNormalization layer, `way`'s way."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    cotangent = torch.randn(shape, generator=generator)
    if way == "torch_nn":
        layer = torch.nn.BatchNorm2d(shape[-1], eps=1e-3, momentum=0.01)
        x_nchw = x.permute(0, 3, 1, 2).contiguous().requires_grad_()
        cotangent_nchw = cotangent.permute(0, 3, 1, 2).contiguous()

        def torch_step() -> None:
            x_nchw.grad = None
            layer(x_nchw).backward(cotangent_nchw)

        return torch_step
    layer = keras.layers.BatchNormalization(center=True, scale=False)
    layer.build(shape)
    x.requires_grad_()
    if way == "keras":

        def keras_step() -> None:
            x.grad = None
            layer(x, training=True).backward(cotangent)

        return keras_step
    # keras_dist's replicas on a one-process group, told there are two so that
    # the global paths run (their collectives then reach this process only).
    replicas = GlobalBatchNorm.Replicas(
        sum=lambda tensor: tensor,
        count=2,
        fused=global_moments,
        normalize=global_batch_norm if way == "global_batch_norm" else None,
    )
    replace_moments(
        layer,
        functools.partial(GlobalBatchNorm.moments, replicas),
        functools.partial(GlobalBatchNorm.normalize, replicas),
    )
    rows = torch.ones(shape[0])

    def keras_dist_step() -> None:
        x.grad = None
        with GlobalBatchNorm.rows(rows, padded=False):
            outputs = layer(x, training=True)
        outputs.backward(cotangent)

    return keras_dist_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch_distributed.init_process_group(
        "gloo", store=torch_distributed.HashStore(), rank=0, world_size=1
    )
    ways = ("keras", "global_moments", "global_batch_norm", "torch_nn")
    result = {}
    for shape in SHAPES:
        steps = {way: layer_step(shape, way) for way in ways}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(args.warmup + args.repeats):
            for way, step in steps.items():  # interleaved
                start = time.perf_counter()
                step()
                if repeat >= args.warmup:
                    times[way].append(time.perf_counter() - start)
        medians = {way: 1e3 * sorted(t)[len(t) // 2] for way, t in times.items()}
        result["x".join(map(str, shape))] = {
            **{f"{way}_ms": round(ms, 3) for way, ms in medians.items()},
            "global_batch_norm / global_moments": round(
                medians["global_batch_norm"] / medians["global_moments"], 3
            ),
        }
    print(json.dumps({"repeats": args.repeats, "layers": result}, indent=2))
    torch_distributed.destroy_process_group()


if __name__ == "__main__":
    main()
