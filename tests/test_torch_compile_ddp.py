"""keras_dist's PyTorch step under `torch.compile` (`jit_compile=True`) on 2
real gloo processes, its gradients averaged after backward (CPU's default)
and by DDP (CUDA's)."""

from __future__ import annotations

import linecache

import numpy as np
import pytest

from tests.multiprocess import once_per_run, run_job

pytestmark = pytest.mark.backend("torch")

# The one place keras_dist's own frames may break a steady-state compiled
# step: its backward pass, which TorchDynamo does not trace (plain Keras'
# compiled step breaks at `Tensor.backward()` too). Under DDP keras_dist runs
# it in an eager function that also sums the metric states beside it
# (`_backward_beside_sum`, which TorchDynamo skips; it also averages the
# gradients there when DDP does not). The other breaks are in torch's and
# Keras' code: DDP's forward (its reducer's bookkeeping, and the frame that
# hands the module to dynamo's DDPOptimizer, which splits the module's graph
# at the gradient buckets), and Keras' SGD (a data-dependent branch on the
# momentum).
KERAS_DIST_BREAKS = {
    "Unsupported Tensor.backward() call": ".backward()",
    "Skip calling `torch.compiler.disable()`d function": "_backward_beside_sum(",
}


@pytest.fixture(scope="module", params=["after_backward", "ddp"])
def results(request, tmp_path_factory):
    return once_per_run(
        tmp_path_factory,
        f"torch_compile_{request.param}",
        lambda directory: run_job(
            "torch_compile_worker.py",
            [],
            processes=2,
            env={
                "KERAS_BACKEND": "torch",
                "KERAS_DIST_TORCH_GRADIENT_SYNC": request.param,
            },
            output_dir=directory,
            timeout=600.0,
        ),
    )


def test_compiled_step_trains_as_the_eager_one(results):
    """12 SGD steps: the compiled step's weights equal the eager step's, and
    every process holds the same weights and logs."""
    for result in results:
        assert result["processes"] == 2
        for compiled, eager in zip(result["compiled"], result["eager"], strict=True):
            np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5)
        for key, values in result["eager_logs"].items():
            np.testing.assert_allclose(
                result["compiled_logs"][key], values, rtol=1e-5, atol=1e-6
            )
    assert results[0]["compiled"] == results[1]["compiled"]
    assert results[0]["compiled_logs"] == results[1]["compiled_logs"]


def test_compiled_step_logs_are_global_every_step(results):
    """Each step's logs of the compiled step (its metric states summed over
    the processes beside the backward pass) equal the eager step's, and are
    the same on every process."""
    for result in results:
        compiled, eager = result["compiled_step_logs"], result["eager_step_logs"]
        assert len(compiled) == len(eager) == 12
        for compiled_step, eager_step in zip(compiled, eager, strict=True):
            assert compiled_step.keys() == eager_step.keys()
            for key, value in eager_step.items():
                np.testing.assert_allclose(
                    compiled_step[key], value, rtol=1e-5, atol=1e-6
                )
    assert results[0]["compiled_step_logs"] == results[1]["compiled_step_logs"]
    assert results[0]["eager_step_logs"] == results[1]["eager_step_logs"]


def test_compiled_step_breaks_in_keras_dist_only_at_backward(results):
    """No break is left unresumed (a frame run eagerly), and a steady-state
    step breaks in keras_dist's frames only at backward, where it sums the
    metric states beside the backward pass."""
    for result in results:
        assert result["not_resumed"] == 0
        report = result["explain"]
        assert report is not None
        assert any(
            found["reason"] == "Skip calling `torch.compiler.disable()`d function"
            and found["frames"]
            and "_backward_beside_sum(" in linecache.getline(*_path_and_line(found))
            for found in report["breaks"]
        ), report["breaks"]
        for found in report["breaks"]:
            innermost = found["frames"][-1] if found["frames"] else ""
            if "/keras_dist/" in innermost:
                assert found["reason"] in KERAS_DIST_BREAKS, found
                path, line = _path_and_line(found)
                assert path.endswith("keras_dist/backends/torch/keras_internals.py"), (
                    found
                )
                # The line that breaks is the backward pass.
                source = linecache.getline(path, line)
                assert KERAS_DIST_BREAKS[found["reason"]] in source, (found, source)


def _path_and_line(found: dict) -> tuple[str, int]:
    """The file and line of a break's innermost frame."""
    path, line = found["frames"][-1].rsplit(":", 1)
    return path, int(line)
