"""Exact global metric results under DDP: one sum of every metric state a step.

Under DDP each process accumulates its metric states over its own rows only.
`MetricSync` sums them over the processes on copies (each process keeps its own
values and goes on accumulating), so the results are the exact global values,
the same on every process. With `average_non_trainable` the same sum averages
the state gradients do not sync (BatchNorm's moving statistics), which then
stays equal on every process.

Making one launches the sum, so that the train step overlaps it with backward:
with `sum_in_backward` (DDP's comm hook, `gradient_rides`) it rides in the
gradient all-reduce instead of a collective of its own. `finish` waits for it.
It runs on every step: plain torch on the variables' tensors (one
concatenation, one sum, in-place copies), not Keras' per-variable `assign`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import torch

_PER_PROCESS = "_keras_dist_per_process"

# States that a float32 sum (the gradient bucket's dtype) keeps exact: float32
# values summed over the processes round to the same float32 as a float64 sum.
# Others (float64, integer counts) take their own float64 sum.
_RIDES_EXACTLY = (torch.float32, torch.float16, torch.bfloat16)

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


class MetricSync:
    """The global metric results of this step (see the module).

    `start_sum` / `sum_in_backward` start summing a float tensor over the
    processes in place and return its wait; `storage` gives the torch tensor a
    Keras variable holds.
    """

    def __init__(
        self,
        model: Any,
        *,
        world_size: int,
        start_sum: Start,
        storage: Callable[[Any], torch.Tensor],
        average_non_trainable: bool,
        sum_in_backward: Start | None = None,
    ):
        self._model = model
        self._world_size = world_size
        self._storage = storage
        self._metrics = list(model.metrics_variables)
        mark_metric_states(self._metrics, per_process=True)
        self._shared = []
        if average_non_trainable:
            self._shared = [
                v for v in model.non_trainable_variables if "float" in str(v.dtype)
            ]
        tensors = [storage(v) for v in (*self._metrics, *self._shared)]
        self._sizes = [tensor.numel() for tensor in tensors]
        with torch.no_grad():
            # This process' own values: kept to be put back after the results.
            self._local = torch.cat(
                [tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors]
            )
            self._flat = self._local.clone()
        start = start_sum
        if sum_in_backward is not None and all(
            tensor.dtype in _RIDES_EXACTLY for tensor in tensors
        ):
            # No collective of its own: it rides with the gradients.
            start = sum_in_backward
        self._wait = start(self._flat)

    def finish(self) -> dict[str, Any]:
        self._wait()
        count = len(self._metrics)
        sums = self._flat.split(self._sizes)
        with torch.no_grad():
            for variable, total in zip(self._shared, sums[count:], strict=True):
                self._put(variable, total / self._world_size)
            for variable, total in zip(self._metrics, sums[:count], strict=True):
                if variable.aggregation == "mean":
                    total = total / self._world_size
                if variable.aggregation in ("sum", "mean"):
                    self._put(variable, total)
        results = keras.tree.map_structure(
            _detached_copy, type(self._model).get_metrics_result(self._model)
        )
        with torch.no_grad():
            own = self._local.split(self._sizes)
            for variable, value in zip(self._metrics, own[:count], strict=True):
                self._put(variable, value)
        return results

    def _put(self, variable: Any, value: torch.Tensor) -> None:
        storage = self._storage(variable)
        storage.copy_(value.view(storage.shape))


def _detached_copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
