"""The user's own steps, run distributed: never replaced, never skipped.

A model may override `train_step`, `test_step` or `predict_step` (or
`compute_loss`, or on JAX `compute_loss_and_updates`): for GANs, contrastive
learning, a loss of its own. keras_dist runs that code in every replica, on
the replica's rows of the global batch, and makes what it computes global:

- Gradients: every optimizer the model holds averages its gradients over the
  replicas before it applies them (in `optimizer.apply`, so `apply_gradients`
  and several optimizers, as in a GAN, are covered), and losses are not scaled
  by the replica count, so a step computes its loss as on one device.
- Padding: a global batch that does not divide the replicas is padded with
  rows of zeros. The step receives the data it would receive from plain Keras
  (same structure); if it carries `sample_weight`, the padding rows' weights
  are 0 and the real rows' weights are multiplied by padded/real rows, so a
  `sum_over_batch_size` loss is the mean over the real rows. Keras' own pieces
  leave the padding out in any case: `compute_loss` called without
  `sample_weight` gets those weights, compiled metrics and loss trackers count
  only the real rows. Values the step computes itself from the raw tensors
  include the padding rows: pass `sample_weight` to `fit` (ones if you have
  none) and use it, or use a batch size that divides the data and replicas.
  On JAX (one process reading the whole batch) an uneven batch is not padded
  at all: it is laid out whole on every device.
- Logs: when the step returns one value per metric of `model.metrics` (as
  Keras' guides do), the logs are the metrics' exact global results.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras

from keras_dist.common import job
from keras_dist.common.padding import masked_row_weights

#: The methods whose override means "the user's own step".
STEP_METHODS = ("train_step", "test_step", "predict_step")


@dataclass(frozen=True)
class StepRows:
    """What the running step knows about its replica's rows.

    Attributes:
        model: the model being stepped.
        mask: 1 for a real row, 0 for padding (this replica's rows).
        loss_weights: the user's sample weights (or 1) times `mask` times
            padded/real rows: a `sum_over_batch_size` loss weighted by them is
            the mean over real rows.
        metric_weights: the user's sample weights (or 1) times `mask`.
        tracked_rows: the weight of this replica's loss in Keras' loss trackers
            (its share of the real rows), instead of its padded row count.
        average_gradients: averages a list of gradients over the replicas
            (None entries kept), or None where something else already does.
        unscaled_losses: Keras' losses are not divided by the replica count
            (TensorFlow strategies do that when the optimizer sums).
    """

    model: Any
    mask: Any
    loss_weights: Any
    metric_weights: Any
    tracked_rows: Any
    average_gradients: Callable[[list[Any]], list[Any]] | None = None
    unscaled_losses: bool = False


_current = threading.local()


def current_rows() -> StepRows | None:
    """The rows of the step running in this thread, or None outside steps."""
    return getattr(_current, "rows", None)


@contextlib.contextmanager
def step_rows(rows: StepRows) -> Iterator[None]:
    """Inside: the step running in this thread has `rows`."""
    previous = current_rows()
    _current.rows = rows
    try:
        yield
    finally:
        _current.rows = previous


def make_rows(
    model: Any,
    data: Any,
    mask: Any,
    scale: Any,
    tracked_rows: Any,
    **options: Any,
) -> StepRows:
    """`StepRows` for a batch `data` whose rows `mask` marks as real, where
    `scale` is the global batch's padded/real row ratio."""
    _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    metric_weights = masked_row_weights(mask, sample_weight)
    loss_weights = metric_weights * keras.ops.cast(scale, metric_weights.dtype)
    return StepRows(
        model=model,
        mask=mask,
        loss_weights=loss_weights,
        metric_weights=metric_weights,
        tracked_rows=tracked_rows,
        **options,
    )


def data_for_step(data: Any, rows: StepRows) -> Any:
    """The batch as the user's step receives it: the same structure, its
    sample weights (if any) zero on padding rows and scaled (see module doc)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if sample_weight is None:
        return data
    return keras.utils.pack_x_y_sample_weight(x, y, rows.loss_weights)


def overridden(model: Any, keras_trainer: type, names: tuple[str, ...]) -> list[str]:
    """The methods of `names` that `model`'s class overrides (its own code)."""
    cls = type(model)
    return [
        name
        for name in names
        if getattr(cls, name, None) is not getattr(keras_trainer, name, None)
    ]


def global_logs(
    model: Any, logs: Any, metric_results: Callable[[], dict[str, Any]]
) -> Any:
    """The logs of a user's step, made global.

    Keras itself reads the epoch's logs from the model's metrics when the
    step's logs name exactly those metrics; keras_dist does the same at every
    step, with `metric_results` (the metrics' global results). Other logs are
    the step's own values, returned as they are.
    """
    results = metric_results()
    if isinstance(logs, dict):
        # A container metric's result is a dict of its metrics' (Keras'
        # compiled metrics): Keras' logs hold them flat.
        flat = set()
        for key, value in logs.items():
            flat |= set(value) if isinstance(value, dict) else {key}
        if flat == set(results):
            return results
    return logs


def warn_padded_once(model: Any, step: str, real: int, padded: int) -> None:
    """Say once per model and step that a user's step got padding rows."""
    job.warn_once(
        f"keras_dist padded a global batch of {real} rows to {padded} so that "
        f"every replica gets the same number of rows, and ran {type(model).__name__}"
        f".{step} (your own) on it. Keras' compute_loss, compiled metrics and loss "
        "trackers leave the padding rows out, and sample_weight (when the data "
        "has it) is 0 on them; values your step computes itself from the raw "
        "tensors include them. Pass sample_weight to fit and use it, or use a "
        "batch size that divides the data and the replicas.",
        UserWarning,
        stacklevel=2,
        key=("padded", id(model), step),
    )
