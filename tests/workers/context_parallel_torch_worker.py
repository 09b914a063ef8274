"""One process of a 2-process PyTorch (gloo, CPU) job that runs torch's own
context parallelism, `torch.distributed.tensor.experimental.context_parallel`,
on what keras_dist's `sequence_axis=` refusal on PyTorch says it lacks.

Usage: python context_parallel_torch_worker.py OUTPUT_JSON

Each case runs causal attention on a query, key and value split along the
sequence inside `context_parallel` and records what happened: the error's type
and message, or "ran". Cases: `sdpa`, torch's SDPA with its default CPU
kernel; `math`, SDPA under `sdpa_kernel(SDPBackend.MATH)`; `keras`, Keras'
`MultiHeadAttention(...)(x, x, use_causal_mask=True)` on the torch backend.
"""

from __future__ import annotations

import json
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

BATCH, HEADS, SEQUENCE, WIDTH = 2, 2, 8, 4


def outcome(run) -> str:
    try:
        run()
    except Exception as error:  # noqa: BLE001  (recorded for the test to judge)
        return f"{type(error).__name__}: {error}"
    return "ran"


def main(output: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("seq",))
    torch.manual_seed(0)
    query, key, value = (torch.randn(BATCH, HEADS, SEQUENCE, WIDTH) for _ in range(3))

    def sdpa(math: bool) -> None:
        with context_parallel(
            mesh, buffers=[query, key, value], buffer_seq_dims=[2] * 3
        ):
            if math:
                with sdpa_kernel([SDPBackend.MATH]):
                    F.scaled_dot_product_attention(query, key, value, is_causal=True)
            else:
                F.scaled_dot_product_attention(query, key, value, is_causal=True)

    layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=WIDTH)
    tokens = torch.randn(BATCH, SEQUENCE, 6)
    layer(tokens, tokens, use_causal_mask=True)  # built outside the context

    def keras_attention() -> None:
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
            layer(tokens, tokens, use_causal_mask=True)

    result = {
        "processes": torch.distributed.get_world_size(),
        "sdpa": outcome(lambda: sdpa(math=False)),
        "math": outcome(lambda: sdpa(math=True)),
        "keras": outcome(keras_attention),
    }
    with open(output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
