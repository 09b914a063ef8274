"""`sequence_axis=` on PyTorch: refused at construction, with an error that
says what torch's own `context_parallel` lacks for Keras' attention; and a
2-process gloo job on CPU that shows torch's `context_parallel` stopping
where that error says it does (if a torch release makes it run, the error's
text is out of date and the test says so)."""

from __future__ import annotations

import re

import pytest

import keras_dist as kd
from tests.multiprocess import run_job_once

pytestmark = pytest.mark.backend("torch")


def _mesh() -> kd.DeviceMesh:
    return kd.DeviceMesh((1, 1), ["batch", "seq"])


DISTRIBUTIONS = {
    "DataParallel": lambda: kd.DataParallel(_mesh(), sequence_axis="seq"),
    "ModelParallel": lambda: kd.ModelParallel(
        layout_map=kd.LayoutMap(_mesh()), sequence_axis="seq"
    ),
    "FSDP": lambda: kd.FSDP(_mesh(), sequence_axis="seq"),
}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_a_sequence_axis_is_refused_naming_what_torch_lacks(name):
    import torch  # noqa: PLC0415  (collected on every backend, run on torch)

    with pytest.raises(NotImplementedError) as raised:
        DISTRIBUTIONS[name]()
    text = str(raised.value)
    cuda = "with" if torch.cuda.is_available() else "without"
    for words in (
        "`sequence_axis` (context parallelism) runs on the JAX backend",
        "PyTorch's own `context_parallel`",
        f"torch {torch.__version__} here, {cuda} CUDA",
        "ring attention only for its CUDA kernels (flash, memory-efficient, cuDNN)",
        "`_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no "
        "sharding strategy for",
        "math kernel, which fails with `is_causal=True`",
        "the ring kernels refuse `attn_mask`",
        "`use_causal_mask=True`, no other mask, no dropout and no returned scores",
        "Use KERAS_BACKEND=jax, or drop `sequence_axis`.",
    ):
        assert words in text, f"{words!r} not in: {text}"


def test_the_refusal_comes_after_the_mesh_checks():
    """A wrong axis is named as such on PyTorch too, before the backend."""
    with pytest.raises(ValueError, match=re.escape("must be an axis of the mesh")):
        kd.ModelParallel(layout_map=kd.LayoutMap(_mesh()), sequence_axis="tokens")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    results, _ = run_job_once(
        tmp_path_factory,
        "context_parallel_torch",
        "context_parallel_torch_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        timeout=240.0,
    )
    return results


def test_torchs_context_parallel_stops_on_cpu_where_the_error_says(job):
    """Causal SDPA split along the sequence inside torch's `context_parallel`
    on 2 gloo CPU processes: the default CPU kernel has no DTensor sharding
    strategy, the math kernel mixes a plain causal mask with DTensors, and
    Keras' MultiHeadAttention reaches the replaced SDPA and stops as the
    default kernel does."""
    stale = (
        "torch's context_parallel ran on CPU: the text of "
        "keras_dist.backends.torch.sequence.why_not is out of date"
    )
    no_strategy = (
        "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does "
        "not have a sharding strategy registered."
    )
    assert [result["processes"] for result in job] == [2, 2]
    for result in job:
        assert "ran" not in result.values(), stale
        assert result["sdpa"] == f"NotImplementedError: {no_strategy}"
        assert result["math"].startswith(
            "RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor"
        )
        assert result["keras"].startswith("NotImplementedError: ")
        assert no_strategy in result["keras"]
