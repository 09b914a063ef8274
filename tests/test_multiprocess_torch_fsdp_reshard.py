"""`kd.FSDP` on PyTorch, 2 gloo processes: whole weights live only while
their layer runs (FSDP2's default `reshard_after_forward=True`).

See `workers/torch_fsdp_reshard_worker.py`.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_job

pytestmark = pytest.mark.backend("torch")


def test_fsdp_frees_whole_weights_between_forward_and_backward(tmp_path):
    results = run_job(
        "torch_fsdp_reshard_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    for result in results:
        alive = result["alive_in_backward"]
        # 4 steps (32 rows in batches of 8): one look per step.
        assert alive["fsdp"] == [False] * 4, result
        # The control: on one device the kernel is the variable itself.
        assert alive["one_device"] == [True] * 4, result
        # Gathered again in backward, the gradients are still those of one device.
        assert result["difference"] < 1e-5, result
