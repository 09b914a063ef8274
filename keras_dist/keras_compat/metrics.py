"""Keras' compiled metrics and loss trackers, made to count only real rows."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras.src.trainers import compile_utils

from keras_dist.common import row_aware
from keras_dist.common.step_rows import StepRows, current_rows, step_rows


def update_compiled_metrics(
    model: Any, y: Any, y_pred: Any, mask: Any, weights: Any
) -> None:
    """`compute_metrics`, but padded rows count in neither kind of metric.

    Keras hands `sample_weight` only to `weighted_metrics`; `metrics` ignore it
    and would count the padding, so they get the mask as their weight.
    """
    compiled = model._compile_metrics
    if compiled is not None:
        if not compiled.built:
            compiled.build(y, y_pred)
        flat_true = compiled._flatten_y(y)
        flat_pred = compiled._flatten_y(y_pred)
        for metric, y_true, y_out in zip(
            compiled._flat_metrics, flat_true, flat_pred, strict=True
        ):
            if metric:
                metric.update_state(y_true, y_out, sample_weight=mask)
        for metric, y_true, y_out in zip(
            compiled._flat_weighted_metrics, flat_true, flat_pred, strict=True
        ):
            if metric:
                metric.update_state(y_true, y_out, sample_weight=weights)


# -- Keras' own pieces inside a keras_dist step (`keras_dist.common.row_aware`) --
# Installed once, for good: outside a keras_dist step (`current_rows()` is None)
# they are Keras' own methods, so plain Keras is never affected.
_KerasCompileMetrics = compile_utils.CompileMetrics
_keras_mean_update_state = keras.metrics.Mean.update_state
_keras_compile_metrics_update_state = _KerasCompileMetrics.update_state
_keras_wrapper_update_state = keras.metrics.MeanMetricWrapper.update_state


def is_loss_tracker(model: Any, metric: Any) -> bool:
    """Whether `metric` is one of the Mean metrics in which Keras tracks the
    loss (the total, and each output's) weighted by the batch's row count."""
    if metric is getattr(model, "_loss_tracker", None):
        return True
    compile_loss = getattr(model, "_compile_loss", None)
    return compile_loss is not None and any(
        metric is tracker for tracker in compile_loss.metrics
    )


def _mean_update_state(self: Any, values: Any, sample_weight: Any = None) -> Any:
    rows = current_rows()
    tracker = rows is not None and is_loss_tracker(rows.model, self)
    sample_weight = row_aware.loss_tracker_weight(rows, sample_weight, tracker)
    return _keras_mean_update_state(self, values, sample_weight=sample_weight)


def _wrapper_update_state(
    self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None
) -> Any:
    sample_weight = row_aware.metric_weights(current_rows(), sample_weight)
    return _keras_wrapper_update_state(
        self, y_true, y_pred, sample_weight=sample_weight
    )


def _compile_metrics_update_state(
    self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None
) -> Any:
    rows = current_rows()
    if rows is None or self is not getattr(rows.model, "_compile_metrics", None):
        return _keras_compile_metrics_update_state(
            self, y_true, y_pred, sample_weight=sample_weight
        )
    # Compiled metrics (`metrics` too, which Keras gives no weight) count only
    # the real rows.
    return update_compiled_metrics(
        rows.model, y_true, y_pred, rows.mask, rows.metric_weights
    )


def install_row_aware_metrics() -> None:
    """Make Keras' loss trackers and compiled metrics count only the real rows
    of a keras_dist step's batch (idempotent)."""
    keras.metrics.Mean.update_state = _mean_update_state
    keras.metrics.MeanMetricWrapper.update_state = _wrapper_update_state
    _KerasCompileMetrics.update_state = _compile_metrics_update_state


def check() -> list[str]:
    """Keras' loss trackers get the batch's row count through `Mean.update_state`
    (per output too), compiled metrics update through `CompileMetrics`, and
    optimizers apply gradients through `apply` (see `install_row_aware_metrics`,
    `average_gradients_in`)."""
    missing = []
    for cls, name in (
        (keras.metrics.Mean, "update_state"),
        (keras.metrics.MeanMetricWrapper, "update_state"),
        (_KerasCompileMetrics, "update_state"),
        (compile_utils.CompileLoss, "metrics"),
        (keras.optimizers.Optimizer, "apply"),
    ):
        if not hasattr(cls, name):
            missing.append(f"{cls.__name__}.{name}")
    if missing:
        return missing
    install_row_aware_metrics()
    inputs = keras.Input((2,))
    model = keras.Model(
        inputs,
        {"a": keras.layers.Dense(1)(inputs), "b": keras.layers.Dense(1)(inputs)},
    )
    model.compile(loss={"a": "mse", "b": "mse"}, metrics={"a": ["mae"]})
    x, y = np.ones((4, 2), "float32"), {"a": np.zeros((4, 1)), "b": np.zeros((4, 1))}
    y_pred = model(x)
    mask = np.array([1.0, 1.0, 1.0, 0.0], "float32")
    rows = StepRows(model, mask, mask, mask, tracked_rows=3.0)
    with step_rows(rows):
        model.compute_loss(x, y, y_pred)
        model.compute_metrics(x, y, y_pred)
    counts = [float(m.count) for m in model._compile_loss.metrics if m]
    if not counts or counts != [3.0] * len(counts):
        missing.append("CompileLoss weighs per-output losses by the row count")
    compiled = [m for m in model._compile_metrics.metrics if hasattr(m, "count")]
    if not compiled or any(float(m.count) != 3.0 for m in compiled):
        missing.append("CompileMetrics.update_state updates the compiled metrics")
    return missing
