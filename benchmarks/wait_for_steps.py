"""What waiting for the steps at each epoch's end and each call's end costs
(JAX): `fit(verbose=0)` of the shared MLP under `kd.DataParallel()`, many
short epochs, with keras_dist's wait and with the wait switched off (the
adapter's `wait_for_steps` replaced by a no-op, so a failed step would go
unnoticed), in turns in one process. Prints each fit's seconds and the
median of the paired ratios (with / without).

    KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 python benchmarks/wait_for_steps.py
    KERAS_BACKEND=jax python benchmarks/wait_for_steps.py --epochs 40  # a chip
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import numpy as np

    import keras_dist as kd
    from benchmarks.mlp import GLOBAL_BATCH, build_model, describe, synthetic_data
    from keras_dist.backends import get_adapter

    adapter = get_adapter()
    x, y = synthetic_data(GLOBAL_BATCH * args.steps)
    model = build_model()

    def fit_seconds(wait: bool) -> float:
        # Switched off on the instance, so the class' method stays as it is.
        if wait:
            adapter.__dict__.pop("wait_for_steps", None)
        else:
            adapter.wait_for_steps = lambda model: None
        try:
            start = time.perf_counter()
            model.fit(
                x,
                y,
                batch_size=GLOBAL_BATCH,
                epochs=args.epochs,
                verbose=0,
                callbacks=[kd.DistributeCallback(kd.DataParallel())],
            )
            # Both ways end with the weights read, as a job's next use would.
            [np.asarray(variable) for variable in model.trainable_variables]
            return time.perf_counter() - start
        finally:
            adapter.__dict__.pop("wait_for_steps", None)

    fit_seconds(True)  # compiles
    ratios = []
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        seconds = {wait: fit_seconds(wait) for wait in order}
        ratios.append(seconds[True] / seconds[False])
        print(
            f"repeat {repeat}: with the wait {seconds[True]:.3f} s, without "
            f"{seconds[False]:.3f} s, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"{describe(model)}; {kd.get_device_count()} devices, {args.epochs} epochs "
        f"of {args.steps} steps: with / without the wait, median "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
