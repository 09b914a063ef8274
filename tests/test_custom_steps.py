"""The user's own steps run distributed, with plain Keras' results.

keras.io's "customizing what happens in fit()" patterns (`tests/workers/
custom_step_models.py`): a `train_step` with `x, y = data` and the compiled
loss and metrics, one with its own loss tracker and metric and sample weights,
a GAN-style step with two optimizers, a `compute_loss` override, `test_step`
and `predict_step` overrides, and a multi-output model with dict losses (whose
per-output losses in `logs` must count only real rows). Each is trained by
plain Keras on one device and under keras_dist -- 8 simulated devices (JAX,
TensorFlow) or 2 gloo processes (PyTorch) -- on 45 rows in global batches of
12, so the last batch (9 rows) divides neither; weights, history, `evaluate`
and `predict` must agree within 1e-5.
"""

from __future__ import annotations

import sys

import pytest

from keras_dist.keras_compat import versions
from tests.conftest import BACKEND
from tests.multiprocess import WORKERS, run_job

sys.path.insert(0, str(WORKERS))
import custom_step_models  # noqa: E402

SCENARIOS = custom_step_models.SCENARIOS


def _skip_reason(name: str) -> str | None:
    if BACKEND == "jax" and name == "two_optimizers":
        # Keras' JAX trainer hands a step only `model.optimizer`'s variables.
        return "Keras' JAX steps are stateless with one optimizer's state"
    if BACKEND == "tensorflow" and name == "output_loss":
        # Its replicas get padded batches: a term over y_pred sees the padding
        # rows, as documented and warned (test below).
        return "TensorFlow pads uneven batches: tested by the warning it gives"
    return None


@pytest.mark.backend("tensorflow")
def test_a_loss_term_of_its_own_on_padded_rows_is_warned_on_tensorflow():
    """An own `compute_loss` is the user's step: on TensorFlow its replicas get
    the padded global batch, and a term it computes from `y_pred` alone counts
    the padding rows. Never silently: the padding warning names the step."""
    import keras_dist as kd  # noqa: PLC0415

    # 45 rows in batches of 12: the last one (9) is padded on 4 or 8 replicas.
    with pytest.warns(UserWarning, match=r"padded a global batch of \d+ rows to \d+"):
        custom_step_models.train("output_loss", kd.DataParallel())


@pytest.mark.backend("jax", "tensorflow")
@pytest.mark.parametrize("name", SCENARIOS)
def test_user_step_matches_plain_keras_on_devices(name):
    import keras_dist as kd  # noqa: PLC0415

    if _skip_reason(name):
        pytest.skip(_skip_reason(name))
    plain = custom_step_models.train(name)
    ours = custom_step_models.train(name, kd.DataParallel())
    custom_step_models.assert_same(ours, plain, except_logs=_per_output_losses(name))


def _per_output_losses(name: str) -> frozenset:
    """The per-output loss logs not compared with plain Keras 3.16 on
    TensorFlow. Its trainer weighs each output's loss tracker by
    `y_pred.shape[0]` as traced: 8 for the full batches (traced with a static
    batch dimension) and 1 for the short last one (traced again, dimension
    unknown, so no weight). That figure is neither the row-weighted mean nor
    3.15's mean of the batch means; keras_dist's 8 replicas trace other shapes.
    The weights and the total `loss`, `val_loss` and evaluate loss are still
    compared (docs/supported-versions.md, known differences)."""
    if name != "multi_output" or BACKEND != "tensorflow":
        return frozenset()
    if versions.keras_version() < (3, 16):
        return frozenset()
    return frozenset(
        f"{prefix}{output}_loss" for prefix in ("", "val_") for output in ("cls", "reg")
    )


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    return run_job(
        "custom_steps_worker.py",
        [",".join(SCENARIOS)],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path_factory.mktemp("custom_steps"),
        timeout=420,
    )


@pytest.mark.backend("torch")
@pytest.mark.parametrize("name", SCENARIOS)
def test_user_step_matches_plain_keras_on_two_processes(two_process_results, name):
    if name == "output_loss":
        # Padded rows reach its own term over y_pred, as warned (test below).
        pytest.skip("the processes get padded batches: tested by the warning")
    for result in two_process_results:
        custom_step_models.assert_same(result[name]["ours"], result[name]["plain"])


@pytest.mark.backend("torch")
def test_a_padded_batch_in_a_user_step_is_announced_once_by_process_zero(
    two_process_results,
):
    rank_0, rank_1 = two_process_results
    warned = rank_0["guide"]["warnings"]
    assert len(warned) == 1, warned
    assert "padded a global batch of 9 rows to 10" in warned[0]
    assert "GuideModel.train_step" in warned[0]
    assert rank_1["guide"]["warnings"] == []
    # Plain Keras steps are not the user's: no warning for them.
    assert rank_0["multi_output"]["warnings"] == []
    # An own compute_loss is (its term over y_pred sees the padding rows).
    (warned,) = rank_0["output_loss"]["warnings"]
    assert "OutputLossModel.train_step" in warned


@pytest.mark.backend("jax")
def test_jax_lays_an_uneven_batch_out_whole_for_a_user_step():
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import keras_dist as kd  # noqa: PLC0415

    seen = []

    class Recording(keras.Model):
        def train_step(self, state, data):
            x, _ = data
            seen.append((x.shape, x.sharding.is_fully_replicated))
            return super().train_step(state, data)

    inputs = keras.Input((3,))
    model = Recording(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    x, y = np.ones((20, 3), "float32"), np.ones((20, 1), "float32")
    model.fit(
        x,
        y,
        batch_size=12,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    assert jax.device_count() == 8
    # 12 rows do not divide 8 devices: whole on each, not padded; the 8 rows
    # of the last batch are split.
    assert seen == [((12, 3), True), ((8, 3), False)]
