"""Trainable weights a step's loss does not reach, under DDP.

Plain Keras trains a model some of whose trainable weights get no gradient in
a step (a head the loss never reads, a branch a step does not take): its
optimizer skips them. torch's `DistributedDataParallel` built without
`find_unused_parameters` cannot: the gradient bucket holding such a weight is
never all-reduced, so the processes stop agreeing (an error at the next step,
or a hang). keras_dist finds them in the loss' autograd graph before backward
(what `find_unused_parameters=True` does inside DDP's forward), adds them to
the loss times zero, so that every bucket is reduced (a zero gradient), and
takes their gradients away again after backward, so that the optimizer skips
them as plain Keras' does. A model whose first step reaches every weight is
not looked at again.
"""

from __future__ import annotations

from typing import Any

import torch


# Eager even inside a compiled step: it walks the loss' autograd graph, which
# TorchDynamo cannot trace. It runs on a model's first step only.
@torch.compiler.disable
def missed_by(loss: Any, trainable: list[Any]) -> list[Any]:
    """The Keras variables of `trainable` whose torch parameters `loss`'s
    autograd graph does not reach."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(function for function, _ in node.next_functions)
    return [v for v in trainable if id(v.value) not in reached]


def reach(loss: Any, unused: list[Any]) -> Any:
    """`loss` plus zero times each of `unused`: the same value, and a zero
    gradient for each, so that DDP all-reduces every bucket."""
    for variable in unused:
        loss = loss + 0.0 * variable.value.sum()
    return loss


def forget(unused: list[Any]) -> None:
    """No gradient for `unused` after backward: the optimizer skips them."""
    for variable in unused:
        variable.value.grad = None
