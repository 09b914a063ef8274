"""keras_dist's train, test and predict steps on tf.distribute, Keras' own
and the user's (each replica's rows, its padding masked; metric states summed
over the replicas; a user's step with its losses unscaled and its gradients
averaged), and the model's preparation from the first batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras import ops
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dist.backends.tensorflow.gradients import (
    accumulate_per_replica,
    accumulates_locally,
    already_summed,
    apply_summed,
    check_accumulation,
    sums_gradients_itself,
)
from keras_dist.backends.tensorflow.input_adapter import DATA, MASK, SCALE
from keras_dist.backends.tensorflow.keras_internals import (
    TensorFlowTrainer,
    global_results,
    mirror_variables,
    recreate_in_scope,
    replica_context,
    with_inner_optimizer,
)
from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.padding import masked_row_weights
from keras_dist.common.row_aware import optimizers_of
from keras_dist.common.step_rows import (
    STEP_METHODS,
    StepRows,
    current_rows,
    data_for_step,
    global_logs,
    make_rows,
    overridden,
    step_rows,
)
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.metrics import update_compiled_metrics
from keras_dist.keras_compat.steps import uses_keras_compute_metrics


# -- steps ---------------------------------------------------------------------
def _split(batch: dict[str, Any]) -> tuple[Any, ...]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch[DATA])
    mask = batch[MASK]
    weights = masked_row_weights(mask, sample_weight)
    # Keras divides each replica's loss by its rows and by the replicas; the
    # padded/real ratio makes the summed gradient the mean over real rows.
    scale = batch[SCALE]
    loss_weights = weights * ops.cast(scale, weights.dtype)
    # This replica's share of the real rows, the loss tracker's weight.
    share = ops.cast(ops.shape(mask)[0], "float32") / scale
    return x, y, mask, weights, loss_weights, share


def _track(model: Any, loss: Any, parts: tuple[Any, ...]) -> None:
    x, y, y_pred, mask, weights, share = parts
    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss), sample_weight=share
    )
    if uses_keras_compute_metrics(model):
        update_compiled_metrics(model, y, y_pred, mask, weights)
    else:
        model.compute_metrics(x, y, y_pred, weights)


# -- the user's own steps --------------------------------------------------------
def user_steps(model: Any) -> set[str]:
    """The steps that run the user's own code, which keras_dist runs as written
    (see `custom_steps`): those `model`'s class overrides, and with its own
    `compute_loss` Keras' train and test steps (which call it), as every loss
    term it adds must be left unscaled and its gradient averaged."""
    steps = set(overridden(model, TensorFlowTrainer, STEP_METHODS))
    if overridden(model, TensorFlowTrainer, ("compute_loss",)):
        steps |= {"train_step", "test_step"}
    return steps


_keras_scale_loss = loss_module.scale_loss_for_distribution


_keras_unscale_loss = loss_module.unscale_loss_for_distribution


def _scale_loss(value: Any) -> Any:
    rows = current_rows()
    if rows is not None and rows.unscaled_losses:
        return value
    return _keras_scale_loss(value)


def _unscale_loss(value: Any) -> Any:
    rows = current_rows()
    if rows is not None and rows.unscaled_losses:
        return value
    return _keras_unscale_loss(value)


def install_unscaled_losses() -> None:
    """Keras divides each replica's losses by the replica count (for optimizers
    that sum the gradients); inside a user's step, whose optimizers average
    them instead, losses are left as one device computes them (idempotent)."""
    loss_module.scale_loss_for_distribution = _scale_loss
    loss_module.unscale_loss_for_distribution = _unscale_loss


def _average_over_replicas(gradients: list[Any]) -> list[Any]:
    context = replica_context()
    present = [i for i, g in enumerate(gradients) if g is not None]
    if context is None or not present:
        return gradients
    averaged = context.all_reduce(
        tf.distribute.ReduceOp.MEAN, [gradients[i] for i in present]
    )
    result = list(gradients)
    for index, value in zip(present, averaged, strict=True):
        result[index] = value
    return result


def _built_outside(build: Callable[..., Any], strategy: Any) -> Callable[..., Any]:
    def build_mirrored(variables: Any) -> Any:
        context = tf.distribute.get_replica_context()
        if context is None:
            return build(variables)

        def in_cross_replica_context(_: Any) -> Any:
            with tf.init_scope(), strategy.scope():
                return build(variables)

        return context.merge_call(in_cross_replica_context)

    return build_mirrored


def average_in_user_steps(model: Any, strategy: Any) -> Callable[[], None]:
    """Every optimizer of `model` runs under `strategy` and leaves the
    gradients' all-reduce to the user's step (`_average_over_replicas`), which
    averages them; return the undo."""
    optimizers = [
        each
        for optimizer in optimizers_of(model)
        for each in with_inner_optimizer(optimizer)
    ]
    if strategy.num_replicas_in_sync > 1:
        for optimizer in optimizers:
            check_accumulation(optimizer, "in a model's own train_step")
    for optimizer in optimizers:
        optimizer._distribution_strategy = strategy
        # Its step counter and learning rate, created with it, are mirrored
        # (the model's own optimizer is mirrored with the model).
        outside = [
            v
            for v in optimizer.variables
            if v._value is not None
            and not strategy.extended.variable_created_in_scope(v._value)
        ]
        if outside:
            recreate_in_scope(strategy, outside, optimizer)
        object.__setattr__(optimizer, "_all_reduce_sum_gradients", already_summed)
        if not optimizer.built:
            # Built lazily at its first `apply`, inside the replica step: its
            # variables are created outside the traced function, mirrored.
            object.__setattr__(
                optimizer, "build", _built_outside(optimizer.build, strategy)
            )

    def undo() -> None:
        for optimizer in optimizers:
            optimizer.__dict__.pop("_all_reduce_sum_gradients", None)
            optimizer.__dict__.pop("build", None)

    return undo


def _user_step(model: Any, step: str, batch: dict[str, Any]) -> Any:
    data, mask, scale = batch[DATA], batch[MASK], batch[SCALE]
    share = ops.cast(ops.shape(mask)[0], "float32") / scale
    rows = make_rows(
        model,
        data,
        mask,
        scale,
        share,
        average_gradients=_average_over_replicas,
        unscaled_losses=True,
    )
    with step_rows(rows), GlobalBatchNorm.rows(mask):
        return getattr(type(model), step)(model, data_for_step(data, rows))


def make_steps(model: Any, user_steps: set[str] = frozenset()) -> dict[str, Callable]:
    def user_train_step(batch: Any) -> Any:
        logs = _user_step(model, "train_step", batch)
        return global_logs(model, logs, lambda: global_results(model))

    def user_test_step(batch: Any) -> Any:
        logs = _user_step(model, "test_step", batch)
        return global_logs(model, logs, lambda: global_results(model))

    def train_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights, share = _split(batch)
        kwargs = {"training": True} if model._call_has_training_arg else {}
        with tf.GradientTape() as tape:
            with GlobalBatchNorm.rows(mask):
                y_pred = model(x, **kwargs)
            with step_rows(StepRows(model, mask, loss_weights, weights, share)):
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=True
                )
            _track(model, loss, (x, y, y_pred, mask, weights, share))
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        trainable = model.trainable_weights
        if not trainable:
            return global_results(model)
        gradients = tape.gradient(loss, trainable)
        if sums_gradients_itself(model.optimizer):
            return apply_summed(model, gradients, trainable)
        model.optimizer.apply_gradients(zip(gradients, trainable, strict=True))
        return global_results(model)

    def test_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights, share = _split(batch)
        kwargs = {"training": False} if model._call_has_training_arg else {}
        y_pred = model(x, **kwargs)
        with step_rows(StepRows(model, mask, loss_weights, weights, share)):
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=False
            )
        _track(model, loss, (x, y, y_pred, mask, weights, share))
        return global_results(model)

    def predict_step(batch: Any) -> Any:
        if "predict_step" in user_steps:
            y_pred = type(model).predict_step(model, batch[DATA])
        else:
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch[DATA])
            kwargs = {"training": False} if model._call_has_training_arg else {}
            y_pred = model(x, **kwargs)
        real = batch[MASK] > 0
        return keras.tree.map_structure(lambda out: tf.boolean_mask(out, real), y_pred)

    return {
        "train_step": user_train_step if "train_step" in user_steps else train_step,
        "test_step": user_test_step if "test_step" in user_steps else test_step,
        "predict_step": predict_step,
    }


def prepare(model: Any, strategy: Any, batch: Any) -> None:
    """Every variable of `model` created by `strategy`, and the model, its
    optimizer and metrics built from a batch's specs.

    Variables created outside the strategy's scope are mirrored first, so the
    optimizer slots the build creates sit next to mirrored variables.
    """
    mirror_variables(model, strategy)
    x, y, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
    with strategy.scope():
        if y is None or getattr(model, "optimizer", None) is None:
            # `predict` (no targets) or a model never compiled: the layers
            # only, as Keras' own `predict` builds them (metrics need targets).
            _build_layers(model, x)
        else:
            model._symbolic_build(data_batch=batch)
    mirror_variables(model, strategy)
    optimizer = getattr(model, "optimizer", None)
    if (
        strategy.num_replicas_in_sync > 1
        and optimizer is not None
        and optimizer.built
        and accumulates_locally(optimizer, model.trainable_variables)
    ):
        accumulate_per_replica(optimizer, strategy)


def _build_layers(model: Any, x: Any) -> None:
    if all(layer.built for layer in layers_of(model)):
        return

    def symbolic(spec: Any) -> Any:
        if spec is None:
            return None
        dtype = keras.backend.standardize_dtype(spec.dtype)
        return keras.KerasTensor(spec.shape, dtype)

    model(keras.tree.map_structure(symbolic, x), training=False)
