"""One rank of a 2-process PyTorch job with activation checkpointing.

Usage: python remat_worker.py OUTPUT
Fits `tests.test_remat`'s model (no Dropout) under
`kd.DataParallel(remat="full")` (DDP), then tries `kd.FSDP(remat="full")`, which
must refuse before any step; writes the weights, history, the blocks' call
count and the refusal to OUTPUT.
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keras_dist as kd  # noqa: E402
from tests import test_remat  # noqa: E402


def main() -> None:
    kd.initialize()
    test_remat.Block.calls = 0
    model, history = test_remat._fit(kd.DataParallel(remat="full"), dropout=False)
    calls = test_remat.Block.calls
    refusal = None
    try:
        test_remat._fit(kd.FSDP(min_size=16, remat="full"), dropout=False)
    except NotImplementedError as error:
        refusal = str(error)
    with open(sys.argv[1], "w") as handle:
        json.dump(
            {
                "weights": [w.tolist() for w in model.get_weights()],
                "history": history,
                "calls": calls,
                "refusal": refusal,
            },
            handle,
        )


if __name__ == "__main__":
    main()
