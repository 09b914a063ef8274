"""The sharding constraints of context parallelism on JAX
(`distribution.sequence`): an activation `[batch, sequence, ...]` split along
the batch axis and the sequence axis, or gathered whole along the sequence
axis (attention's keys and values). Dimensions after the second are left to
XLA (`PartitionSpec.UNCONSTRAINED`): a model axis that splits attention's
heads keeps them split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.backends.jax.keras_internals import xla_attention_only

__all__ = ["constraint", "xla_attention_only"]


def _size(mesh: Any, axis: str | None) -> int:
    return 1 if axis is None else int(mesh.shape[axis])


def constraint(mesh: Any, batch_axis: str, sequence_axis: str | None) -> Callable:
    """A function that lays a layer's output out as `[batch_axis,
    sequence_axis (None: whole), ...]` inside a traced step. A tuple or list
    output (an attention layer's output with its cache or scores) has its
    first element laid out. Arrays outside a trace, of rank below 2, or whose
    dimensions the axes do not divide are returned as they are."""
    batch_parts = _size(mesh, batch_axis)
    sequence_parts = _size(mesh, sequence_axis)

    def lay_out(array: Any) -> Any:
        if not isinstance(array, jax.core.Tracer) or array.ndim < 2:
            return array
        if array.shape[0] % batch_parts or array.shape[1] % sequence_parts:
            return array
        spec = PartitionSpec(
            batch_axis,
            sequence_axis,
            *([PartitionSpec.UNCONSTRAINED] * (array.ndim - 2)),
        )
        return jax.lax.with_sharding_constraint(array, NamedSharding(mesh, spec))

    def constrain(outputs: Any) -> Any:
        if isinstance(outputs, (tuple, list)) and outputs:
            return type(outputs)([lay_out(outputs[0]), *outputs[1:]])
        return lay_out(outputs)

    return constrain
