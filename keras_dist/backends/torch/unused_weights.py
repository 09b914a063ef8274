"""Trainable weights a step's loss does not reach, under DDP.

Plain Keras trains a model some of whose trainable weights get no gradient in
a step (a head the loss never reads, a branch a step does not take): its
optimizer skips them. torch's `DistributedDataParallel` built without
`find_unused_parameters` cannot: the gradient bucket holding such a weight is
never all-reduced, so the processes stop agreeing (an error at the next step,
or a hang). keras_dist finds them in the loss' autograd graph before backward
(what `find_unused_parameters=True` does inside DDP's forward), adds them to
the loss times zero, so that every bucket is reduced (a zero gradient), and
after backward takes away the gradients of those no process' loss reached, so
that the optimizer skips them as plain Keras' does; one another process' loss
reached keeps the average, on every process alike. A model whose first step
reaches every weight on every process is not looked at again. (Gradients
averaged after backward need none of this: `average_after_backward` sends
zeros for a missing gradient and a flag saying which processes had one.)
"""

from __future__ import annotations

from collections.abc import Callable
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


@torch.compiler.disable
def agree(
    unused: list[Any],
    trainable: list[Any],
    start_sum: Callable[[Any], Callable[[], None]],
    world_size: int,
) -> tuple[list[Any], list[Any]]:
    """(the weights of `trainable` some process' loss missed, those every
    process' missed), from each process' `unused`: one all-reduce of a flag
    per weight (a collective)."""
    missed = {id(variable) for variable in unused}
    flags = torch.tensor([float(id(v) in missed) for v in trainable]).double()
    start_sum(flags)()
    counts = flags.tolist()
    anywhere = [v for v, count in zip(trainable, counts, strict=True) if count > 0]
    everywhere = [v for v, c in zip(trainable, counts, strict=True) if c == world_size]
    return anywhere, everywhere


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
