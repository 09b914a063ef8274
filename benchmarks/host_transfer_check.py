"""The compiled plan's host term against a step that moves state from pinned
host memory to the chip and back.

One jitted step brings an Adam-like moment pair (two `--size` x `--size`
float32 arrays) in from pinned host memory, updates them and a weight on the
device, and writes them back, as `offload="optimizer"` does for one variable:
`--size` 8192 moves 512 MiB each way. It prints the median step over 10 runs
(after 2 warm-up runs), the bytes moved each way, and the roofline's host term
for them (`keras_dist.common.accelerators`: the chip's host bandwidth), as one
JSON line.

    KERAS_BACKEND=jax python benchmarks/host_transfer_check.py   # on the chip
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    import jax
    import numpy as np

    from keras_dist.common.accelerators import kind_of

    device = jax.devices()[0]
    single = jax.sharding.SingleDeviceSharding
    host = single(device, memory_kind="pinned_host")
    on_device = single(device, memory_kind="device")

    def step(weight, first, second):
        first = jax.device_put(first, on_device) * 0.9 + 0.1
        second = jax.device_put(second, on_device) * 0.99 + 0.01
        return (
            weight - first / (second + 1.0),
            jax.device_put(first, host),
            jax.device_put(second, host),
        )

    jitted = jax.jit(
        step, out_shardings=(on_device, host, host), donate_argnums=(0, 1, 2)
    )
    shape = (args.size, args.size)
    state = (
        jax.device_put(np.ones(shape, "float32"), on_device),
        jax.device_put(np.ones(shape, "float32"), host),
        jax.device_put(np.ones(shape, "float32"), host),
    )
    times = []
    for _ in range(12):
        began = time.perf_counter()
        state = jitted(*state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - began)
    steady = sorted(times[2:])
    moved = 2 * args.size * args.size * 4
    kind = kind_of(device.device_kind)
    bandwidth = None if kind is None else kind.host_bandwidth
    print(
        json.dumps(
            {
                "device_kind": device.device_kind,
                "step_ms": steady[len(steady) // 2] * 1e3,
                "moved_each_way_bytes": moved,
                "host_term_ms": None if not bandwidth else moved / bandwidth * 1e3,
            }
        )
    )


if __name__ == "__main__":
    main()
