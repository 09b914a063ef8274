"""Gradient accumulation on tf.distribute that all-reduces once per weight update.

With `gradient_accumulation_steps=k`, Keras' optimizer adds every micro-step's
gradient to an accumulator and updates the weights on every k-th micro-step
from the accumulated sum over k. Summing each micro-step's gradients over the
replicas first, as a step without accumulation does, sends every gradient
over the network k times per update.

Here each accumulator is a variable that every replica keeps its own copy of
and that is summed when read from outside a replica (`ON_READ`
synchronization, `SUM` aggregation; Keras' metric states are the same kind).
A micro-step adds each replica's gradient to its own copy: no communication.
The update step sums the copies over every replica in one batched reduction,
updates the weights and sets the copies back to zero. Keras' accumulators are
such variables, so whoever reads them outside the step (`get_weights`,
`model.save`, a checkpoint) gets the sum over every replica of every
micro-gradient so far, which is what plain Keras holds on one device; and
TensorFlow restores a summed variable by dividing the saved sum among the
replicas, so a checkpoint taken between two updates resumes with the partial
sum intact, whatever the number of replicas.

The optimizer's own part (which micro-step updates, the update's arithmetic,
the step counter) is Keras' and comes from `gradients`
(`KerasAccumulation`); this module holds the tf.distribute part.
"""

from __future__ import annotations

from typing import Any, Protocol

import tensorflow as tf


class Accumulating(Protocol):
    """An optimizer with `gradient_accumulation_steps`, as Keras computes it."""

    def accumulate(self, strategy: Any, gradients: list[Any]) -> list[tuple[Any, Any]]:
        """(gradient, accumulator) pairs for the gradients that exist, in
        order; each accumulator a variable of `strategy` summed on read."""

    def micro_gradient(self, gradient: Any) -> Any:
        """What one replica adds to its accumulator for `gradient`."""

    def is_update_step(self) -> Any:
        """Whether this micro-step updates the weights (a boolean tensor)."""

    def update(self, strategy: Any, summed: list[Any]) -> None:
        """Update the weights from the sums of the accumulated gradients over
        every replica, in the order `accumulate` gave them."""

    def end_micro_step(self) -> None:
        """What follows every micro-step, an update or not (the counter)."""


def apply(context: Any, optimizer: Accumulating, gradients: list[Any]) -> None:
    """Inside a replica: add this replica's `gradients` to its accumulators and,
    on an update step, sum the accumulators over every replica once and update.

    The rest runs once, in the cross-replica context (`merge_call`): Keras'
    choice between updating and accumulating is a `tf.cond`, and TensorFlow
    cannot run a `merge_call` inside a condition in a replica, which the
    update's variable writes and the reduction would need there.
    """

    def in_cross_replica_context(strategy: Any, gradients: list[Any]) -> None:
        _accumulate_and_update(strategy, optimizer, gradients)

    context.merge_call(in_cross_replica_context, args=(gradients,))


def _accumulate_and_update(
    strategy: Any, optimizer: Accumulating, gradients: list[Any]
) -> None:
    extended = strategy.extended
    pairs = optimizer.accumulate(strategy, gradients)
    accumulators = [accumulator for _, accumulator in pairs]

    def add(copy: Any, gradient: Any) -> Any:
        return copy.assign_add(optimizer.micro_gradient(gradient))

    def reset(copy: Any) -> Any:
        return copy.assign(tf.zeros(copy.shape, copy.dtype))

    for gradient, accumulator in pairs:
        # Each replica's own gradient into its own copy: a per-replica gradient
        # is split among the copies, nothing crosses replicas.
        extended.update(accumulator, add, args=(gradient,), group=False)

    def reduce_and_update() -> None:
        # One batched reduction of every accumulator (on MultiWorkerMirrored
        # one packed all-reduce), into each variable's own devices.
        summed = extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(a, a) for a in accumulators]
        )
        totals = [strategy.experimental_local_results(s)[0] for s in summed]
        with tf.control_dependencies(totals):
            for accumulator in accumulators:
                extended.update(accumulator, reset, group=False)
        optimizer.update(strategy, totals)

    tf.cond(optimizer.is_update_step(), reduce_and_update, lambda: None)
    optimizer.end_micro_step()
