"""The rules that make Keras' own pieces count only a padded batch's real rows.

Inside a keras_dist step (`step_rows.current_rows()` is not None) a global
batch that does not divide the replicas is padded; these rules say what the
loss, the metrics and the gradients get instead of what Keras would give them:

- a metric handed the step's loss weights (scaled by padded/real rows for the
  loss' sake) gets the unscaled ones, so each real row counts once
  (`metric_weights`);
- a loss tracker, which Keras weighs by the batch's row count, gets the
  replica's share of the real rows instead (`loss_tracker_weight`);
- `model.compute_loss` called without `sample_weight` gets the step's loss
  weights (`inject_loss_weights`);
- every optimizer averages its gradients over the replicas first when the
  step's rows say how (`average_gradients_in`).

`keras_dist.keras_compat.metrics` installs the metric rules into Keras' classes;
outside a keras_dist step they change nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras

from keras_dist.common.step_rows import StepRows, current_rows


def metric_weights(rows: StepRows | None, sample_weight: Any) -> Any:
    """The weights a metric counts with: a step's own metric given the step's
    loss weights (scaled by padded/real rows for the loss' sake) counts each
    real row once, with the unscaled ones."""
    if rows is not None and sample_weight is rows.loss_weights:
        return rows.metric_weights
    return sample_weight


def loss_tracker_weight(
    rows: StepRows | None, sample_weight: Any, is_loss_tracker: bool
) -> Any:
    """The weight a loss tracker counts a batch's loss with.

    Keras weighs a batch's loss by its row count (an int, or a scalar tensor on
    TensorFlow): the padded count in a padded batch, where only the real rows
    should count.
    """
    sample_weight = metric_weights(rows, sample_weight)
    if (
        rows is not None
        and sample_weight is not None
        and len(getattr(sample_weight, "shape", ())) == 0
        and is_loss_tracker
    ):
        return rows.tracked_rows
    return sample_weight


def inject_loss_weights(model: Any) -> Callable[[], None]:
    """Make `model.compute_loss` called without `sample_weight` inside a
    keras_dist step use the step's loss weights (padding rows 0); return the
    undo. The model's own `compute_loss` runs, with those weights."""
    method = type(model).compute_loss
    if "sample_weight" not in inspect.signature(method).parameters:
        return lambda: None

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        rows = current_rows()
        if rows is not None and rows.model is model:
            if len(args) >= 4:
                if args[3] is None:
                    args = (*args[:3], rows.loss_weights, *args[4:])
            elif kwargs.get("sample_weight") is None:
                kwargs["sample_weight"] = rows.loss_weights
        return method(model, *args, **kwargs)

    object.__setattr__(model, "compute_loss", compute_loss)
    return lambda: model.__dict__.pop("compute_loss", None)


def optimizers_of(model: Any) -> list[Any]:
    """Every optimizer `model` holds as an attribute (`optimizer`, and e.g. a
    GAN's `d_optimizer` and `g_optimizer`), once each."""
    found: list[Any] = []
    for value in list(vars(model).values()):
        if isinstance(value, keras.optimizers.Optimizer) and not any(
            value is other for other in found
        ):
            found.append(value)
    return found


def average_gradients_in(optimizers: list[Any]) -> Callable[[], None]:
    """Make each optimizer's `apply` (and so `apply_gradients`) average the
    gradients over the replicas first, inside a keras_dist step whose rows say
    how (`StepRows.average_gradients`); return the undo."""
    for optimizer in optimizers:
        method = type(optimizer).apply

        def apply(
            grads: Any,
            trainable_variables: Any = None,
            _optimizer: Any = optimizer,
            _method: Callable[..., Any] = method,
        ) -> Any:
            rows = current_rows()
            if rows is not None and rows.average_gradients is not None:
                grads = rows.average_gradients(list(grads))
            return _method(_optimizer, grads, trainable_variables)

        object.__setattr__(optimizer, "apply", apply)

    def undo() -> None:
        for optimizer in optimizers:
            optimizer.__dict__.pop("apply", None)

    return undo
