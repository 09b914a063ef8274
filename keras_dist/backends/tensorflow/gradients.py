"""How the gradients reach the variables on tf.distribute: one batched
all-reduce of every gradient per step (`fuse_gradient_all_reduce`), and with
`gradient_accumulation_steps` one per update, accumulated per replica in
between (`accumulate_per_replica`, on `accumulation`'s per-replica sums; the
optimizer's own arithmetic is Keras', `KerasAccumulation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from keras_dist.backends.tensorflow import accumulation
from keras_dist.backends.tensorflow.keras_internals import (
    MetricStates,
    global_results,
    recreate_in_scope,
    replica_context,
    summed_on_read,
    tf_variable,
    with_inner_optimizer,
)


def sums_gradients_itself(optimizer: Any) -> bool:
    return optimizer.__dict__.get("_all_reduce_sum_gradients") is already_summed


def already_summed(grads_and_vars: Any) -> list[Any]:
    return list(grads_and_vars)


def fuse_gradient_all_reduce(optimizer: Any) -> Callable[[], None]:
    """Let the train step sum the gradients (with the metric states, in one
    all-reduce) instead of the optimizer; return the undo.

    A `LossScaleOptimizer` (mixed precision) then checks the summed gradients
    for inf/nan, the same on every replica: an overflow on one replica makes
    every replica skip the step and halve the loss scale together, as one
    device does. (Left to Keras, it checks the first local replica's own
    gradients and its inner optimizer sums and applies them all: measured,
    another replica's overflow reaches the weights as NaN in one process, and
    in a 2-process job the ranks decide differently and the next all-reduce
    times out.)
    """
    optimizers = with_inner_optimizer(optimizer)
    for each in optimizers:
        object.__setattr__(each, "_all_reduce_sum_gradients", already_summed)

    def undo() -> None:
        for each in optimizers:
            each.__dict__.pop("_all_reduce_sum_gradients", None)

    return undo


def _apply_accumulating(
    context: Any, optimizer: Any, gradients: list[Any], trainable: list[Any]
) -> None:
    """Apply summed gradients with `gradient_accumulation_steps` in the
    cross-replica context, with Keras' own `apply` (for the optimizers that
    do not accumulate per replica, see `accumulates_locally`).

    Keras' optimizer chooses between updating the weights and adding to its
    accumulators in a `tf.cond` whose branches update mirrored variables
    through `merge_call`, which TensorFlow cannot run inside a condition in a
    replica (plain Keras under `MirroredStrategy` fails so). Here the whole
    `apply` runs once, in the cross-replica context, on the summed gradients,
    which every replica holds alike (the first local replica's are taken);
    each variable update still reaches every device.
    """

    def apply(strategy: Any, gradients: list[Any]) -> None:
        local = [
            None if g is None else strategy.experimental_local_results(g)[0]
            for g in gradients
        ]
        with _without_merge_call(strategy):
            optimizer.apply_gradients(zip(local, trainable, strict=True))

    context.merge_call(apply, args=(gradients,))


@contextlib.contextmanager
def _without_merge_call(strategy: Any) -> Iterator[None]:
    """Keras' optimizer asks for a `merge_call` when the strategy uses them;
    in the cross-replica context it is not needed (nor possible)."""
    extended = strategy.extended
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        del extended._use_merge_call


def accumulates_locally(optimizer: Any, trainable: list[Any]) -> bool:
    """Whether `optimizer` accumulates in per-replica accumulators summed once
    per update (`accumulation`).

    Two Keras features keep the sum of every micro-step's gradients and Keras'
    own `apply` (`_apply_accumulating`), with the same results: variables
    overwritten with their gradient (float8 training; Keras accumulates their
    maximum, not their sum) and weights' moving averages (`use_ema`).
    """
    if not optimizer.gradient_accumulation_steps or optimizer.use_ema:
        return False
    return not any(getattr(v, "overwrite_with_gradient", False) for v in trainable)


def accumulate_per_replica(optimizer: Any, strategy: Any) -> None:
    """Back `optimizer`'s gradient accumulators by variables of `strategy`
    that each replica keeps its own copy of and that are summed on read
    (`accumulation`), holding the same sums (idempotent).

    Their creation is kept out of the traced step (`tf.init_scope`): a
    `tf.function` that creates variables is traced a second time.
    """
    shared = [
        a
        for a in optimizer._accumulated_gradients
        if a is not None
        and not (
            summed_on_read(a) and strategy.extended.variable_created_in_scope(a._value)
        )
    ]
    for accumulator in shared:
        accumulator._synchronization = "on_read"
        accumulator._aggregation = "sum"
    if shared:
        with tf.init_scope():
            recreate_in_scope(strategy, shared, None)


class KerasAccumulation:
    """Keras' own accumulation arithmetic for `accumulation.apply`.

    That of `BaseOptimizer.apply` and `_backend_apply_gradients` (Keras
    3.15): variables it was not built for raise Keras' error, gradients
    missing are left out (with Keras' warning), each micro-gradient is
    divided by `loss_scale_factor`, the update step is the
    k-th micro-step counted by `_iterations` (which counts micro-steps), its
    gradients are the accumulated sums over k, clipped, after Keras' weight
    decay, and the variables' constraints are applied after every micro-step.
    """

    def __init__(self, optimizer: Any, trainable: list[Any]) -> None:
        self._optimizer = optimizer
        self._trainable = trainable
        self._updated: list[Any] = []

    def accumulate(self, strategy: Any, gradients: list[Any]) -> list[tuple[Any, Any]]:
        optimizer = self._optimizer
        if not optimizer.built:
            # Keras' `apply` builds it here; its variables are the strategy's.
            with tf.init_scope(), strategy.scope():
                optimizer.build(self._trainable)
        optimizer._check_variables_are_known(self._trainable)
        present, self._updated = optimizer._filter_empty_gradients(
            gradients, self._trainable
        )
        # Done by `prepare` unless the optimizer was built just now.
        accumulate_per_replica(optimizer, strategy)
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
            for v in self._updated
        ]
        return list(zip(present, [tf_variable(a) for a in accumulators], strict=True))

    def micro_gradient(self, gradient: Any) -> Any:
        scale = self._optimizer.loss_scale_factor
        return gradient if scale is None else gradient / scale

    def is_update_step(self) -> Any:
        optimizer = self._optimizer
        steps = optimizer.gradient_accumulation_steps
        return (optimizer._iterations + 1) % steps == 0

    def update(self, strategy: Any, summed: list[Any]) -> None:
        optimizer = self._optimizer
        steps = optimizer.gradient_accumulation_steps
        gradients = optimizer._clip_gradients([s / steps for s in summed])
        with _without_merge_call(strategy):
            optimizer._apply_weight_decay(self._updated)
            optimizer._backend_update_step(
                gradients, self._updated, optimizer.learning_rate
            )

    def end_micro_step(self) -> None:
        for variable in self._updated:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        self._optimizer._iterations.assign_add(1)


def check_accumulation(optimizer: Any, where: str) -> None:
    """Raise for `gradient_accumulation_steps` that would be applied inside a
    replica, which TensorFlow cannot run (see `_apply_accumulating`)."""
    accumulating = [
        each.name
        for each in with_inner_optimizer(optimizer)
        if getattr(each, "gradient_accumulation_steps", None)
    ]
    if accumulating:
        raise ValueError(
            f"Optimizer {accumulating[0]!r} has `gradient_accumulation_steps`, "
            f"which keras_dist cannot run on TensorFlow {where} with more than "
            "one replica (its update inside a replica needs a `merge_call` in "
            "a `tf.cond`, which TensorFlow rejects). Leave it out, or train "
            "with Keras' own train_step and an optimizer not wrapped in a "
            "LossScaleOptimizer, or use the JAX or PyTorch backend."
        )


def apply_summed(model: Any, gradients: list[Any], trainable: list[Any]) -> Any:
    """Sum the gradients and the metric states over replicas in one
    all-reduce, apply the gradients, return the global metric results.

    With `gradient_accumulation_steps` the gradients are, in most cases,
    summed once per update instead (`accumulation`)."""
    context = replica_context()
    if context is None:
        model.optimizer.apply_gradients(zip(gradients, trainable, strict=True))
        return model.get_metrics_result()
    if accumulates_locally(model.optimizer, trainable):
        # The gradients stay each replica's own until the update step; the
        # metric states are summed at every step (exact global logs).
        accumulation.apply(
            context, KerasAccumulation(model.optimizer, trainable), gradients
        )
        return global_results(model)
    states = MetricStates(model, context) if model.metrics_variables else None
    present = [i for i, g in enumerate(gradients) if g is not None]
    values = [gradients[i] for i in present]
    if states is not None:
        values.append(states.flat)
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    total = list(gradients)
    for index, value in zip(present, summed, strict=False):
        total[index] = value
    if model.optimizer.gradient_accumulation_steps:
        _apply_accumulating(context, model.optimizer, total, trainable)
    else:
        # A LossScaleOptimizer applies its inner optimizer inside the replica.
        check_accumulation(model.optimizer, "in a LossScaleOptimizer")
        model.optimizer.apply_gradients(zip(total, trainable, strict=True))
    if states is None:
        return model.get_metrics_result()
    return states.results(summed[-1])
