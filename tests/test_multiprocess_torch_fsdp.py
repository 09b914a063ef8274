"""`kd.FSDP` on PyTorch, 2 gloo processes: a model with more than Dense layers.

The plain FSDP and FSDP x tensor parallelism parity tests are in
`test_multiprocess_torch.py`; this one trains the model of
`workers/torch_fsdp_worker.py` (a layer's added loss and an activity
regularizer from each process' rows, a weight regularizer, a tied weight, a
frozen layer).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.multiprocess import run_job

pytestmark = pytest.mark.backend("torch")


def test_fsdp_with_layer_losses_tied_and_frozen_weights_trains_like_one_device(
    tmp_path,
):
    results = run_job(
        "torch_fsdp_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    rows = {
        0: ["Tensor [5, 6]", "Tensor [6, 6]"],
        1: ["Tensor [4, 6]", "Tensor [6, 6]"],
    }
    for result in results:
        # Adam updates each process' parts; global_clipnorm needs whole gradients.
        for optimizer in ("adam", "clipped"):
            case = result[optimizer]
            assert case["difference"] < 1e-5, (optimizer, case)
            fsdp, one_device = case["losses"]
            np.testing.assert_allclose(fsdp, one_device, atol=1e-5)
            # Each process computes on its rows (batches of 12, then 9) as
            # plain tensors.
            assert case["fsdp_layer_inputs"] == rows[result["process_id"]]
    assert results[0]["adam"]["losses"] == results[1]["adam"]["losses"]
