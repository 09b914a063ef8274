"""Plain compute for pure FSDP on PyTorch: what FSDP2 does, inside `ShardedRun`.

When every sharded variable is split along the batch axis only (no other mesh
axis of size > 1 splits one), no BatchNormalization layer and no split
non-trainable variable is in the model (`plain_compute_group`), a
`ShardedRun` (`keras_dist.backends.torch.dtensor`) computes the model on plain
tensors instead of DTensors:

```
model call       this process' rows of every input (no communication)
  layer call     its own DTensor variables gathered whole in one all-gather
                 (`fsdp_compute.gather_layer_variables`), held for the call,
                 freed when its forward ends, gathered again in its backward
  read outside   a tied weight, a weight regularizer in the loss: gathered
  its layer      once per model call (`read_variable`, `reading()`)
model outputs    every process' rows, in order (`fsdp_compute.gather_rows`)
added losses     averaged over processes, weighted by rows
optimizer        an elementwise one (Adam, SGD...) updates each process'
                 parts as plain tensors, in place (`local_update`)
```

Between steps and in the optimizer update the variables are the run's
DTensors as in DTensor compute; callbacks and checkpoints see the same. An op
inside the model that mixes rows sees this process' rows only, as under
DataParallel. The gradient arithmetic is in `fsdp_compute`'s docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_dist.backends.torch import keras_internals as internals
from keras_dist.backends.torch.fsdp_compute import (
    BatchGroup,
    ReshardAfterForward,
    chunk_bounds,
    gather_layer_variables,
    gather_rows,
    sum_over_processes,
    to_full,
)
from keras_dist.keras_compat.optimizers import update_in_pieces


def _local_bytes(variable: Any) -> int:
    """The bytes of what `variable` holds now (this process' part)."""
    value = variable.value
    return value.numel() * value.element_size()


# The fewest bytes the optimizer updates in one go (`PlainCompute._piece_bytes`).
_SMALLEST_PIECE = 4 * 2**20

# Keras optimizers that update each element of a variable from the same
# element of its gradient and slots (see `PlainCompute.updates_elementwise`).
_ELEMENTWISE_OPTIMIZERS = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Nadam",
        "Lion",
        "Ftrl",
    }
)


def plain_compute_group(
    mesh: Any,
    batch_axis: int | None,
    batch_dim_name: str,
    values: dict[int, Any],
    layers: list[Any],
) -> BatchGroup | None:
    """The processes along the batch axis when plain compute applies, else
    None.

    Not without a batch axis of size > 1 (`batch_axis` None); not with a
    variable split along another mesh axis of size > 1 (that needs DTensor's
    ops); not with a BatchNormalization layer, whose statistics span the rows
    of every process (DTensor compute reduces them, plain compute would not);
    not with a split variable that a layer created non-trainable: such
    statistics are assigned while the layer runs, from every process' rows,
    and a layer in plain compute writes to a whole copy
    (`PlainCompute.check_not_written`).

    Args:
        mesh: the torch `DeviceMesh`.
        batch_axis: the index of the batch axis in the mesh, or None.
        batch_dim_name: its name.
        values: id(variable) -> its DTensor Parameter, for every variable the
            run made a DTensor.
        layers: the model and every layer in it.
    """
    if batch_axis is None:
        return None
    sizes = mesh.shape
    for value in values.values():
        for axis, placement in enumerate(value.placements):
            if axis != batch_axis and sizes[axis] > 1 and not placement.is_replicate():
                return None
    if any(isinstance(layer, keras.layers.BatchNormalization) for layer in layers):
        return None
    for layer in layers:
        for variable in internals.own_non_trainable_variables(layer):
            value = values.get(id(variable))
            if value is not None and not all(
                placement.is_replicate() for placement in value.placements
            ):
                return None
    return BatchGroup(
        group=mesh.get_group(batch_dim_name),
        size=int(sizes[batch_axis]),
        index=int(mesh.get_local_rank(batch_dim_name)),
    )


# The plain computes whose model is being called (or whose loss is being
# computed), innermost last: a variable read then gathers its whole value.
_reading: list[PlainCompute] = []


def read_variable(variable: Any, value: Any) -> Any:
    """What reading `variable` (holding `value`) gives: its whole value while
    a plain compute reads, else `value`."""
    if _reading and isinstance(value, DTensor):
        return _reading[-1].gather_on_read(variable, value)
    return value


class PlainCompute:
    """The plain compute of one `ShardedRun` (see the module docstring).

    Args:
        model: the Keras model.
        mesh: the torch `DeviceMesh`.
        batch: the processes along the batch axis (`plain_compute_group`).
        batch_axis: the batch axis' index in the mesh.
        values: the run's id(variable) -> DTensor Parameter (shared, not
            copied: what each variable holds between layers).
        variables: the run's variables made DTensors (shared).
        layers: the model and every layer in it.
        calling: the run's stack of layers being called, innermost last
            (shared: the run names the innermost one in its errors).
        reduce_dtype: the dtype gradients are summed in (None: their own).
    """

    def __init__(
        self,
        *,
        model: Any,
        mesh: Any,
        batch: BatchGroup,
        batch_axis: int,
        values: dict[int, Any],
        variables: list[Any],
        layers: list[Any],
        calling: list[Any],
        reduce_dtype: str | None = None,
    ):
        self.model = model
        # The dtype gradients are summed over processes in (a mixed-precision
        # policy's `reduce_dtype`; None: the dtype they are computed in).
        self.reduce_dtype = getattr(torch, reduce_dtype) if reduce_dtype else None
        self.mesh = mesh
        self.batch = batch
        self._batch_axis = batch_axis
        self._values = values
        self._variables = variables
        self._layers = layers
        self._calling = calling
        # id(layer) -> [its gathered variables, how many calls hold them, the
        # gathered values' versions (to see writes)].
        self._layer_gathers: dict[int, list[Any]] = {}
        # Whole values of variables read outside their own layer's call, for
        # one model call: id(variable) -> [variable, whole value, its version].
        self._read_cache: dict[int, list[Any]] = {}
        # Frees those whole values when their layer's forward ends and
        # gathers them again in its backward.
        self._reshard = ReshardAfterForward()
        self._rows: list[int] = []  # rows of the whole batch, per model call
        # Elementwise optimizer: id(variable) -> a Parameter sharing its
        # DTensor's local storage, for the optimizer's update.
        self._locals: dict[int, torch.nn.Parameter] = {}
        self._piece_size: int | None = None
        self.updates_locally = self.updates_elementwise()

    # -- the forward hooks -------------------------------------------------------
    def enter(self, layer: Any, args: Any) -> Any:
        """A layer's forward pre-hook: this process' rows of the model's
        inputs; the layer's whole variables."""
        self._calling.append(layer)
        split = None
        if layer is self.model:
            # This process' rows of every input, as plain tensors (no
            # communication: every process holds the whole batch).
            batch = self.batch
            rows = [
                int(value.shape[0])
                for value in keras.tree.flatten(args)
                if isinstance(value, torch.Tensor) and value.ndim > 0
            ]
            self._rows.append(rows[0] if rows else 0)

            def own_rows(value: Any) -> Any:
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    return value
                value = to_full(value)
                start, length = chunk_bounds(value.shape[0], batch.size, batch.index)
                return value.narrow(0, start, length)

            split = keras.tree.map_structure(own_rows, args)
            _reading.append(self)
        self._gather_layer(layer)
        return split

    def leave(self, layer: Any, args: Any, outputs: Any) -> Any:
        """A layer's forward hook: its variables' parts again; the model's
        outputs with every process' rows."""
        if self._calling and self._calling[-1] is layer:
            self._calling.pop()
        self._release_layer(layer)
        if layer is not self.model:
            return None
        self._end_reads()
        total = self._rows.pop() if self._rows else 0
        self._average_added_losses(total)
        batch = self.batch
        own = chunk_bounds(total, batch.size, batch.index)[1]

        def whole_rows(value: Any) -> Any:
            # An output with this process' rows: every process' rows, in order.
            # Anything else was computed from whole tensors and is the same on
            # every process.
            if isinstance(value, DTensor):
                return to_full(value)
            if (
                isinstance(value, torch.Tensor)
                and value.ndim > 0
                and value.shape[0] == own
            ):
                return gather_rows(batch, total, value)
            return value

        return keras.tree.map_structure(whole_rows, outputs)

    # -- a layer's whole variables -------------------------------------------------
    def _gather_layer(self, layer: Any) -> None:
        """The whole values of the layer's own DTensor variables, in one
        collective, held by the variables while the layer runs."""
        held = self._layer_gathers.get(id(layer))
        if held is not None:
            held[1] += 1
            return
        variables = [
            variable
            for variable in internals.own_variables(layer)
            if isinstance(internals.variable_storage(variable), DTensor)
        ]
        if not variables:
            return
        # A weight Keras' autocast reads cast (a mixed policy) is cast before
        # its gather: the same whole value, in half the bytes.
        casts = [internals.reads_cast(layer, variable) for variable in variables]
        whole, regathers = gather_layer_variables(
            self.batch,
            self.mesh,
            self._batch_axis,
            [internals.variable_storage(variable) for variable in variables],
            gather_dtypes=[getattr(torch, cast) if cast else None for cast in casts],
            reduce_dtype=self.reduce_dtype,
        )
        self._reshard.hold(whole, regathers)
        for variable, value in zip(variables, whole, strict=True):
            internals.set_variable_storage(variable, value)
        self._layer_gathers[id(layer)] = [
            variables,
            1,
            [value._version for value in whole],
        ]

    def _release_layer(self, layer: Any) -> None:
        held = self._layer_gathers.get(id(layer))
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del self._layer_gathers[id(layer)]
        variables, _, versions = held
        gathered = []
        for variable, version in zip(variables, versions, strict=True):
            gathered.append([variable, internals.variable_storage(variable), version])
            internals.set_variable_storage(variable, self._values[id(variable)])
        self._reshard.release([whole for _, whole, _ in gathered])
        self.check_not_written(layer, gathered)

    # -- activation checkpointing ----------------------------------------------
    def gathered_layers(self) -> set[int]:
        """The layers (ids) whose variables are gathered now."""
        return set(self._layer_gathers)

    def gather_for_recomputation(self, layer: Any) -> None:
        """`layer`'s own variables whole again while the backward pass runs its
        call again (`ShardedRun.recomputable`)."""
        self._gather_layer(layer)

    def release_since(self, held: set[int]) -> None:
        """Every layer's variables gathered since `held` back to their parts
        (a recomputation's, hook or not)."""
        for key in [key for key in self._layer_gathers if key not in held]:
            variables, _, _ = self._layer_gathers.pop(key)
            wholes = [internals.variable_storage(variable) for variable in variables]
            for variable in variables:
                internals.set_variable_storage(variable, self._values[id(variable)])
            self._reshard.release(wholes)

    def check_not_written(self, layer: Any, gathered: list[list[Any]]) -> None:
        """Refuse an assignment to a gathered whole value of a split variable
        ([variable, whole value, its version when gathered]): it would be
        lost, only the variable's parts are kept."""
        written = [
            variable.path
            for variable, whole, version in gathered
            if whole._version != version
            and any(not p.is_replicate() for p in self._values[id(variable)].placements)
        ]
        if written:
            raise NotImplementedError(
                f"Variables {written} were assigned while layer "
                f"{getattr(layer, 'path', None) or layer.name!r} "
                f"({type(layer).__name__}) ran. FSDP on PyTorch gives a layer the "
                "whole values of variables split along the batch axis for its "
                "call and does not write them back. Keep such variables whole: "
                "raise `min_size` above their size or lay them out replicated "
                "in the LayoutMap."
            )

    # -- variables read outside their layer -----------------------------------------
    def gather_on_read(self, variable: Any, value: DTensor) -> Any:
        """The whole value of a variable read, inside the model's call, outside
        its own layer's call (a weight tied to another layer's): gathered once
        per model call, its gradient reduce-scattered like a layer's."""
        held = self._read_cache.get(id(variable))
        if held is None:
            (whole,), regathers = gather_layer_variables(
                self.batch,
                self.mesh,
                self._batch_axis,
                [value],
                reduce_dtype=self.reduce_dtype,
            )
            self._reshard.hold([whole], regathers)
            held = self._read_cache[id(variable)] = [variable, whole, whole._version]
        return held[1]

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Inside (the loss computation of keras_dist's steps): a variable read
        (a weight regularizer) gets its whole value, as inside the model, so
        that the loss is a plain tensor; its gradient comes back through
        `fsdp_compute`'s reduce-scatter."""
        _reading.append(self)
        try:
            yield
        finally:
            self._end_reads()

    def _end_reads(self) -> None:
        """Stop gathering variables read outside their layer: free the whole
        values read (their backward gathers them again) and check that none
        was written."""
        if _reading and _reading[-1] is self:
            _reading.pop()
        read = list(self._read_cache.values())
        self._read_cache.clear()
        self._reshard.release([whole for _, whole, _ in read])
        self.check_not_written(self.model, read)

    def _average_added_losses(self, total: int) -> None:
        """Losses that layers added (`add_loss`, activity regularizers) from
        this process' rows: replaced by their average over processes, weighted
        by rows, the same on every process (a loss that is a mean over rows is
        then the whole batch's, as on one device). Differentiable: see
        `fsdp_compute` for the gradient's arithmetic."""
        added = [
            (losses, index, loss)
            for layer in self._layers
            for losses in (internals.added_losses(layer),)
            for index, loss in enumerate(losses)
        ]
        if not added:
            return
        batch = self.batch
        own = chunk_bounds(total, batch.size, batch.index)[1]
        weight = own / total if total else 1.0 / batch.size
        flat = torch.cat([loss.reshape(-1) for _, _, loss in added])
        summed = sum_over_processes(batch, flat * weight)
        offset = 0
        for losses, index, loss in added:
            losses[index] = summed[offset : offset + loss.numel()].reshape(loss.shape)
            offset += loss.numel()

    # -- the step ----------------------------------------------------------------
    def reshard_hooks(self) -> contextlib.AbstractContextManager:
        """Inside a step: a layer's whole weights are freed after its forward
        and gathered again in its backward."""
        return self._reshard.hooks()

    def release_all(self) -> None:
        """After a step, every variable holds its own part again (a layer that
        raised never reached its forward hook)."""
        for variables, _, _ in self._layer_gathers.values():
            for variable in variables:
                internals.set_variable_storage(variable, self._values[id(variable)])
        self._layer_gathers.clear()
        self._read_cache.clear()
        self._reshard.clear()
        self._rows.clear()
        while self in _reading:
            _reading.remove(self)

    # -- the optimizer update -------------------------------------------------------
    def updates_elementwise(self) -> bool:
        """Whether the model's optimizer updates each element of a variable
        from the same element of its gradient and slots only, so that each
        process can update its parts as plain tensors: Keras' own optimizers
        that do (not a subclass, which may do more), without clipping by a
        norm, and with no optimizer variable but scalars outside the run."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return False
        kind = type(optimizer)
        if (
            kind.__name__ not in _ELEMENTWISE_OPTIMIZERS
            or not kind.__module__.startswith("keras.")
            or getattr(optimizer, "clipnorm", None) is not None
            or getattr(optimizer, "global_clipnorm", None) is not None
        ):
            return False
        return all(
            id(variable) in self._values or len(variable.shape) == 0
            for variable in optimizer.variables
        )

    def release_locals(self) -> None:
        """Forget the plain Parameters sharing the DTensors' parts (when the
        run stops: they would keep the parts alive)."""
        self._locals.clear()

    def _piece_bytes(self) -> int:
        """The most bytes of this process' parts the optimizer updates in one
        go (`keras_compat.optimizers.update_in_pieces`): an eighth of its share of the
        trainable variables, or its largest variable's part if larger, and at
        least `_SMALLEST_PIECE`. Keras' Adam makes three temporaries as large
        as what one go updates; in 8 goes they hold 3/8 of the share instead of
        3 times it, for at most 8 Python calls of the update a step (each about
        0.2 ms: a share under 4 MiB is one go, its temporaries are small)."""
        if self._piece_size is None:
            sizes = [
                value.to_local().numel() * value.element_size()
                for variable in self.model.trainable_variables
                if (value := self._values.get(id(variable))) is not None
            ]
            self._piece_size = max([sum(sizes) // 8, _SMALLEST_PIECE, *sizes])
        return self._piece_size

    @contextlib.contextmanager
    def local_update(self) -> Iterator[None]:
        """The optimizer's update with an elementwise optimizer: every DTensor
        variable and slot holds its local part as a plain Parameter, its
        gradient's local part as `.grad`, so Keras' foreach ops run on plain
        tensors, in place on the DTensors' own storage (call under
        `no_grad`)."""
        try:
            for variable in self._variables:
                value = self._values[id(variable)]
                local = self._locals.get(id(variable))
                if local is None:
                    # Shares the DTensor's local storage; made once per run.
                    local = torch.nn.Parameter(
                        value.to_local(), requires_grad=value.requires_grad
                    )
                    self._locals[id(variable)] = local
                grad = value.grad
                if grad is not None and tuple(grad.placements) != tuple(
                    value.placements
                ):
                    grad = grad.redistribute(self.mesh, value.placements)
                local.grad = None if grad is None else grad.to_local()
                internals.set_variable_storage(variable, local)
            with update_in_pieces(
                self.model.optimizer, self._piece_bytes(), _local_bytes
            ):
                yield
        finally:
            for variable in self._variables:
                internals.set_variable_storage(variable, self._values[id(variable)])
            for local in self._locals.values():
                local.grad = None  # the DTensor keeps its gradient
