"""One rank of a 2-process PyTorch job with activation checkpointing.

Usage: python remat_worker.py OUTPUT
Fits `tests.test_remat`'s model (no Dropout) with `remat="full"` under
`kd.DataParallel` (DDP), `kd.FSDP` (with its BatchNormalization: DTensor
compute; without: plain compute, as FSDP2) and a `kd.ModelParallel` that splits
the blocks' kernels along a model axis, and `kd.FSDP(remat="dots")`; writes
each fit's weights, history and the blocks' call count to OUTPUT.
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keras_dist as kd  # noqa: E402
from tests import test_remat  # noqa: E402


def _model_parallel() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((1, 2), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*_up/kernel"] = (None, "model")
    layout_map[".*_down/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch", remat="full")


def main() -> None:
    kd.initialize()
    fits = {
        "ddp": (kd.DataParallel(remat="full"), True),
        "fsdp": (kd.FSDP(min_size=16, remat="full"), True),
        "fsdp_plain_compute": (kd.FSDP(min_size=16, remat="full"), False),
        "model_parallel": (_model_parallel(), False),
        # Selective checkpointing with the DTensor gathers of a recomputation.
        "fsdp_dots": (kd.FSDP(min_size=16, remat="dots"), True),
    }
    results = {}
    for name, (distribution, batch_norm) in fits.items():
        test_remat.Block.calls = 0
        model, history = test_remat._fit(
            distribution, dropout=False, batch_norm=batch_norm
        )
        results[name] = {
            "weights": [w.tolist() for w in model.get_weights()],
            "history": history,
            "calls": test_remat.Block.calls,
            "batch_norm": batch_norm,
        }
    with open(sys.argv[1], "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
