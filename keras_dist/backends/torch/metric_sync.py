"""Exact global metric results under DDP: one sum of every metric state a step.

Under DDP each process accumulates its metric states over its own rows only.
`MetricSync` sums them over the processes on copies (each process keeps its own
values and goes on accumulating), so the results are the exact global values,
the same on every process. With `average_non_trainable` the same sum averages
the state gradients do not sync (BatchNorm's moving statistics), which then
stays equal on every process.

`start()` launches the sum (an asynchronous all-reduce the train step starts
before backward, so that it runs beside it) and returns a `PendingSum` whose
`finish()` waits for it and reads the results. Under `torch.compile`,
`traced_copy()` copies the states in the form TorchDynamo traces; the compiled
step sums that buffer eagerly beside its backward pass (where its graph breaks
anyway; inside the graph after it for a gradient-accumulation micro-step or a
model without trainable weights) and `TracedStates.finish()` reads the results.

Eagerly, the states' layout (which tensors, their sizes, which are averaged) is
worked out once and kept while the model's metric states are the same
variables; each step is then a few fused torch ops on flat float64 buffers: one
copy in, the sum, one division, one copy out, Keras' own results, one copy
back. The sum is taken in float64, so a float32 state's global value is exactly
the rounded sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import torch

_PER_PROCESS = "_keras_dist_per_process"

Start = Callable[[Any], Callable[[], None]]


def mark_metric_states(variables: list[Any], *, per_process: bool) -> None:
    """Record whether each process holds its own value of these metric states
    (DDP, summed by `MetricSync`) or the same global one (one process,
    DTensor): checkpoints save the global value of per-process states."""
    for variable in variables:
        setattr(variable, _PER_PROCESS, per_process)


def metric_state_is_per_process(variable: Any) -> bool:
    """Whether `variable` is a metric state each process holds its own value
    of (see `mark_metric_states`)."""
    return bool(getattr(variable, _PER_PROCESS, False))


class _Layout:
    """Where each state sits in the flat buffers, for one set of variables."""

    def __init__(
        self,
        metrics: list[Any],
        shared: list[Any],
        *,
        world_size: int,
        storage: Callable[[Any], torch.Tensor],
    ):
        mark_metric_states(metrics, per_process=True)
        tensors = [storage(v) for v in (*metrics, *shared)]
        sizes = [tensor.numel() for tensor in tensors]
        # This process' own values (kept to be put back after the results),
        # and the buffer summed over the processes.
        self.local = torch.zeros(sum(sizes), dtype=torch.float64)
        self.flat = torch.zeros_like(self.local)
        self.tensors = tensors
        self.local_views = _views(self.local, sizes, tensors)
        flat_views = _views(self.flat, sizes, tensors)
        # Summed states that are written back: BatchNorm's statistics and the
        # metric states aggregated by sum or mean. Averaged ones are divided.
        divisor = torch.ones_like(self.local)
        self.put: list[torch.Tensor] = []
        self.put_from: list[torch.Tensor] = []
        self.restore: list[torch.Tensor] = []
        self.restore_from: list[torch.Tensor] = []
        offset = 0
        for index, (variable, size) in enumerate(
            zip((*metrics, *shared), sizes, strict=True)
        ):
            is_metric = index < len(metrics)
            aggregation = variable.aggregation if is_metric else "mean"
            if aggregation == "mean":
                divisor[offset : offset + size] = world_size
            if aggregation in ("sum", "mean"):
                self.put.append(tensors[index])
                self.put_from.append(flat_views[index])
                if is_metric:
                    self.restore.append(tensors[index])
                    self.restore_from.append(self.local_views[index])
            offset += size
        self.divisor = divisor


def _views(flat: torch.Tensor, sizes: list[int], like: list[torch.Tensor]) -> list:
    return [
        part.view(tensor.shape)
        for part, tensor in zip(flat.split(sizes), like, strict=True)
    ]


class MetricSync:
    """The global metric results of each step (see the module).

    `start_sum` starts summing a float64 tensor over the processes in place
    and returns its wait; `storage` gives the torch tensor a Keras variable
    holds.
    """

    def __init__(
        self,
        model: Any,
        *,
        world_size: int,
        start_sum: Start,
        storage: Callable[[Any], torch.Tensor],
        average_non_trainable: bool,
    ):
        self._model = model
        self._world_size = world_size
        self._start_sum = start_sum
        self._storage = storage
        self._average_non_trainable = average_non_trainable
        self._key: tuple[int, ...] | None = None
        self._layout: _Layout | None = None

    def _variables(self) -> tuple[list[Any], list[Any]]:
        """The metric states, and the float non-trainable variables averaged
        with them (`average_non_trainable`)."""
        model = self._model
        shared = []
        if self._average_non_trainable:
            shared = [
                v for v in model.non_trainable_variables if "float" in str(v.dtype)
            ]
        return list(model.metrics_variables), shared

    def _current_layout(self) -> _Layout:
        metrics, shared = self._variables()
        # Metrics built late (on their first update) or a new `compile()`
        # change the variables: the layout is made again.
        key = (len(metrics), *map(id, metrics), *map(id, shared))
        if self._layout is None or key != self._key:
            self._layout = _Layout(
                metrics, shared, world_size=self._world_size, storage=self._storage
            )
            self._key = key
        return self._layout

    def results(self) -> dict[str, Any]:
        """The global results now. Under `torch.compile` in the form it
        traces: the sum inside the graph, no layout kept between steps."""
        if torch.compiler.is_compiling():
            traced = self.traced_copy()
            self._start_sum(traced.flat)()
            return traced.finish()
        return self.start().finish()

    def traced_copy(self) -> TracedStates:
        """The states as they are now, copied into a float64 buffer in the
        form `torch.compile` traces (no layout kept between steps); nothing
        is summed yet. Sum its `flat` over the processes (`start_sum`, inside
        the graph or eagerly beside the backward pass), then `finish()`."""
        metrics, shared = self._variables()
        variables = (*metrics, *shared)
        tensors = [self._storage(v) for v in variables]
        with torch.no_grad():
            local = torch.cat(
                [tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors]
            )
        return TracedStates(
            self._model,
            self._world_size,
            len(metrics),
            variables,
            tensors,
            local,
            local.clone(),
        )

    def start(self) -> PendingSum:
        """Start summing the states as they are now (they must not change
        until `finish`)."""
        layout = self._current_layout()
        with torch.no_grad():
            if layout.tensors:
                torch._foreach_copy_(layout.local_views, layout.tensors)
            layout.flat.copy_(layout.local)
        return PendingSum(self._model, layout, self._start_sum(layout.flat))


@dataclass
class TracedStates:
    """`MetricSync.traced_copy`'s buffers; `finish()` gives the global
    results once `flat` holds the sum over the processes. The first
    `metric_count` of `variables` are metric states, the rest the state
    averaged with them; `local` keeps this process' own values."""

    model: Any
    world_size: int
    metric_count: int
    variables: tuple[Any, ...]
    tensors: list[torch.Tensor]
    local: torch.Tensor
    flat: torch.Tensor

    def finish(self) -> dict[str, Any]:
        tensors, metric_count = self.tensors, self.metric_count
        sizes = [tensor.numel() for tensor in tensors]
        with torch.no_grad():
            for index, (variable, tensor, total) in enumerate(
                zip(self.variables, tensors, self.flat.split(sizes), strict=True)
            ):
                aggregation = variable.aggregation if index < metric_count else "mean"
                if aggregation == "mean":
                    total = total / self.world_size
                if aggregation in ("sum", "mean"):
                    tensor.copy_(total.view(tensor.shape))
        results = keras.tree.map_structure(
            _detached_copy, type(self.model).get_metrics_result(self.model)
        )
        with torch.no_grad():
            for variable, tensor, own in zip(
                self.variables[:metric_count],
                tensors,
                self.local.split(sizes),
                strict=False,
            ):
                if variable.aggregation in ("sum", "mean"):
                    # Each process goes on from its own values.
                    tensor.copy_(own.view(tensor.shape))
        return results


class PendingSum:
    """A started sum of the states; `finish()` gives the global results."""

    def __init__(self, model: Any, layout: _Layout, wait: Callable[[], None]):
        self._model = model
        self._layout = layout
        self._wait = wait

    def finish(self) -> dict[str, Any]:
        self._wait()
        layout = self._layout
        with torch.no_grad():
            layout.flat.div_(layout.divisor)
            if layout.put:
                torch._foreach_copy_(layout.put, layout.put_from)
        results = keras.tree.map_structure(
            _detached_copy, type(self._model).get_metrics_result(self._model)
        )
        with torch.no_grad():
            if layout.restore:
                # Each process goes on from its own values.
                torch._foreach_copy_(layout.restore, layout.restore_from)
        return results


def _detached_copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
