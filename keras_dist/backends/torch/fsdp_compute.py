"""FSDP on PyTorch with plain-tensor compute, as FSDP2 does it.

When every sharded variable is split along the batch axis only (pure FSDP:
`kd.FSDP` without a model axis that splits variables), DTensor's per-op
dispatch buys nothing: each layer can run on whole weights and this process'
rows as plain tensors. `ShardedRun` then uses the autograd functions here
instead of DTensor ops:

- `gather_layer_variables`: at each layer call, one all-gather per
  batch-split variable the layer owns, issued together and waited together,
  brings its whole value, each into a buffer of its own: a value split along
  its first dimension is that buffer, with no copy (FSDP2 gathers a module's
  parameters into one buffer and copies each out, which holds the layer's
  weights twice for a moment). Its backward is one reduce-scatter per
  variable, issued together, each straight from the gradient, that leaves
  each process the average over processes of the gradient of its own part;
  a replicated variable's gradient is reduce-scattered from every process'
  whole gradient written into every process' slot, so it is averaged too.
  The gradients come back as DTensors laid out like their variables.
  (Measured in `benchmarks/README.md`: one buffer per layer, copied in and
  out, put the whole run's peak above `fully_shard`'s.)
- `ReshardAfterForward` / `Regather`: the whole values live only while their
  layer's forward runs (FSDP2's default, `reshard_after_forward=True`). What
  the layer's ops save of them for backward is saved as a handle
  (`saved_tensors_hooks`), and the layer's backward all-gathers them again,
  once, from the parts: two all-gathers per layer and step, and a peak of one
  layer's whole weights at a time instead of the whole model's.
- `gather_rows`: the model's outputs, each process' rows, gathered into the
  whole batch's outputs on every process (the loss and the metrics are
  computed on the whole batch, the same on every process). Its backward
  returns this process' rows of the gradient times the number of processes.
- `sum_over_processes`: what layers computed from this process' rows alone
  (the losses they add, weighted by rows), summed into the same value on
  every process. Its backward sums the gradient over processes: N times this
  process' share, as `gather_rows` gives.

Why an average and that factor: every process computes the same loss from
the same whole outputs. A gradient that reaches a weight through the outputs
then depends on this process' rows only (a partial sum): times N, averaged
over the N processes, it is the sum of the parts, the whole gradient. A
gradient that does not pass through the outputs (a layer called on whole
tensors in a custom step) is already whole and the same on every process:
its average is itself. The rows are split as DTensor's
`Shard(0)` splits them (`torch.chunk`), so uneven batches need no padding of
the data, only of the collective's buffers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_distributed
from torch.distributed.tensor import DTensor, Shard

# torch 2.13 renamed the collectives into flat tensors; torch 2.4 has the old names.
_all_gather = getattr(
    torch_distributed, "all_gather_single", torch_distributed.all_gather_into_tensor
)
_reduce_scatter = getattr(
    torch_distributed, "reduce_scatter_single", torch_distributed.reduce_scatter_tensor
)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` of `size` items split as `torch.chunk`
    (and DTensor's `Shard`) split them: parts of ceil(size / parts), the last
    ones shorter or empty."""
    step = math.ceil(size / parts) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


@dataclass(frozen=True)
class BatchGroup:
    """The processes along the batch axis of the mesh: its process group,
    their number and this process' index among them."""

    group: Any
    size: int
    index: int


@dataclass(frozen=True)
class _Spec:
    """How one variable of a layer is gathered: `dim` is the dimension split
    along the batch axis (None: replicated along it)."""

    dim: int | None
    shape: tuple[int, ...]
    placements: tuple
    stride: tuple[int, ...]
    # The variable's dtype, and the one its whole value is gathered in (its
    # layer's compute dtype under a mixed policy: cast before the gather).
    dtype: torch.dtype
    gather_dtype: torch.dtype

    def padded_shape(self, parts: int) -> tuple[int, ...]:
        """The shape of one process' part, padded to the largest part."""
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] = math.ceil(shape[self.dim] / parts)
        return tuple(shape)


def _pad_along(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`tensor` with zeros appended along `dim` up to `length`: every process
    sends the same number of elements, as the collectives need."""
    if tensor.shape[dim] == length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return padded


# A variable split along its first dimension whose whole value has at least
# this many bytes is gathered, and its gradient reduce-scattered, by a
# collective of its own (into, and straight from, its own whole tensor), the
# layer's other variables together in one. Below it, one more collective costs
# more time than copying the value through a shared buffer (on gloo, a
# collective's fixed cost is a fraction of a millisecond, about what copying
# 4 MiB takes); above it the copy is what would lift the peak (the layer's
# weights, or gradients, held twice: `benchmarks/README.md`).
_OWN_COLLECTIVE_BYTES = 4 * 2**20


def _alone(spec: _Spec, element_size: int) -> bool:
    """Whether `spec`'s variable gets collectives of its own (see above);
    decided from the global shape, so every process decides alike."""
    return spec.dim == 0 and math.prod(spec.shape) * element_size >= (
        _OWN_COLLECTIVE_BYTES
    )


def _gather_wholes(
    batch: BatchGroup, specs: Sequence[_Spec], locals_: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Whole plain values from this process' parts (`locals_`, laid out as
    `specs` say): a large variable split along its first dimension in an
    all-gather of its own, into a buffer that is its whole value (no copy);
    the others in one all-gather into a shared buffer, copied out. The
    collectives (every process calls them) are issued together and waited
    together."""
    parts = batch.size
    blocks: list[torch.Tensor | None] = [None] * len(specs)
    pending = []
    bundled = []
    locals_ = [
        local.to(spec.gather_dtype) if local.dtype != spec.gather_dtype else local
        for spec, local in zip(specs, locals_, strict=True)
    ]
    for index, (spec, local) in enumerate(zip(specs, locals_, strict=True)):
        if spec.dim is None:
            continue
        padded = _pad_along(local, spec.dim, spec.padded_shape(parts)[spec.dim])
        if not _alone(spec, local.element_size()):
            bundled.append((index, padded.reshape(-1)))
            continue
        send = padded.contiguous().reshape(-1)
        whole = send.new_empty(parts * send.numel())
        pending.append(_all_gather(whole, send, group=batch.group, async_op=True))
        blocks[index] = whole.view(parts, *spec.padded_shape(parts))
    gathered = None
    if bundled:
        send = torch.cat([flat for _, flat in bundled])
        gathered = send.new_empty(parts * send.numel())
        pending.append(_all_gather(gathered, send, group=batch.group, async_op=True))
    for work in pending:
        work.wait()
    if gathered is not None:
        gathered = gathered.view(parts, -1)
        offset = 0
        for index, flat in bundled:
            padded_shape = specs[index].padded_shape(parts)
            blocks[index] = gathered[:, offset : offset + flat.numel()].reshape(
                parts, *padded_shape
            )
            offset += flat.numel()
    outputs: list[torch.Tensor] = []
    for spec, local, block in zip(specs, locals_, blocks, strict=True):
        if block is None:
            outputs.append(local.view_as(local))
            continue
        padded = spec.padded_shape(parts)
        # (parts, ..., part, ...) -> (..., parts * part, ...), then the padding
        # at the end of the split dimension cut off (a view of the buffer for
        # a variable gathered alone, split along its first dimension and not
        # padded).
        whole = block.movedim(0, spec.dim).reshape(
            *padded[: spec.dim], -1, *padded[spec.dim + 1 :]
        )
        outputs.append(whole.narrow(spec.dim, 0, spec.shape[spec.dim]).contiguous())
    return tuple(outputs)


class Regather:
    """How to gather one `gather_layer_variables` bucket again, for backward.

    The whole values a layer's ops save for backward (a matmul saves its
    weight) are what keeps them alive from the layer's forward to its
    backward. `ShardedRun` packs them as this handle instead (a
    `saved_tensors_hooks` pack), so they are freed when the layer's forward
    ends, and `wholes()` all-gathers them again from the parts when backward
    first needs one: FSDP2's default `reshard_after_forward=True`. The
    gathered values are kept only while a saved tensor still refers to this
    handle (autograd frees a node's saved tensors once it has run), so one
    all-gather serves all of the layer's backward ops. The parts do not change
    between a forward and its backward (the optimizer runs after), so the
    values are the forward's; every process runs the same backward graph, in
    the same order, so the all-gathers match across processes.
    """

    def __init__(
        self, batch: BatchGroup, specs: Sequence[_Spec], values: Sequence[DTensor]
    ):
        self.batch, self.specs, self.values = batch, tuple(specs), tuple(values)
        self._wholes: tuple[torch.Tensor, ...] | None = None

    def wholes(self) -> tuple[torch.Tensor, ...]:
        """The bucket's whole values, all-gathered on the first call."""
        if self._wholes is None:
            with torch.no_grad():
                self._wholes = _gather_wholes(
                    self.batch, self.specs, [value.to_local() for value in self.values]
                )
        return self._wholes


class _GatherLayer(torch.autograd.Function):
    """Whole plain values of a layer's DTensor variables (see the module)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        batch: BatchGroup,
        mesh: Any,
        specs: Sequence[_Spec],
        reduce_dtype: torch.dtype | None,
        *values: Any,
    ) -> tuple[torch.Tensor, ...]:
        ctx.batch, ctx.mesh, ctx.specs = batch, mesh, specs
        ctx.reduce_dtype = reduce_dtype
        ctx.set_materialize_grads(False)
        return _gather_wholes(batch, specs, [value.to_local() for value in values])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        batch, specs = ctx.batch, ctx.specs
        parts = batch.size
        if ctx.reduce_dtype is not None:
            # Summed over processes in the policy's reduce dtype (float32:
            # each bfloat16 gradient cast up before its reduce-scatter).
            grads = tuple(
                None if grad is None else grad.to(ctx.reduce_dtype) for grad in grads
            )
        # Each (parts, n): what goes to each process. A large variable split
        # along its first dimension is reduce-scattered alone, straight from
        # its gradient (a view); the others from one buffer they are copied
        # into (see `_OWN_COLLECTIVE_BYTES`).
        rows: dict[int, torch.Tensor] = {}
        for index, (spec, grad, needed) in enumerate(
            zip(specs, grads, ctx.needs_input_grad[4:], strict=True)
        ):
            if grad is None or not needed:
                continue
            if spec.dim is None:
                # Every process receives this process' whole gradient: the
                # reduce-scatter sums it over processes (an all-reduce).
                flat = grad.reshape(1, -1)
                rows[index] = flat.expand(parts, flat.shape[1])
                continue
            padded = spec.padded_shape(parts)
            grad = _pad_along(grad, spec.dim, padded[spec.dim] * parts)
            split = grad.reshape(
                *padded[: spec.dim], parts, padded[spec.dim], *padded[spec.dim + 1 :]
            )
            rows[index] = split.movedim(spec.dim, 0).reshape(parts, -1)
        if not rows:
            return (None, None, None, None, *(None for _ in specs))
        received: dict[int, torch.Tensor] = {}
        buffers = []  # what the reduce-scatters write: divided once each
        pending = []
        bundled = []
        for index, row in rows.items():
            if not _alone(specs[index], row.element_size()):
                bundled.append(index)
                continue
            received[index] = row.new_empty(row.shape[1])
            buffers.append(received[index])
            pending.append(
                _reduce_scatter(
                    received[index], row.reshape(-1), group=batch.group, async_op=True
                )
            )
        if bundled:
            send = torch.cat([rows[index] for index in bundled], dim=1)
            together = send.new_empty(send.shape[1])
            buffers.append(together)
            pending.append(
                _reduce_scatter(
                    together, send.reshape(-1), group=batch.group, async_op=True
                )
            )
            offset = 0
            for index in bundled:
                width = rows[index].shape[1]
                received[index] = together[offset : offset + width]
                offset += width
        del rows
        for work in pending:
            work.wait()
        for buffer in buffers:
            buffer.div_(parts)
        results: list[Any] = []
        for index, spec in enumerate(specs):
            part = received.get(index)
            if part is None:
                results.append(None)
                continue
            if spec.dim is None:
                local = part.view(spec.shape)
            else:
                padded = spec.padded_shape(parts)
                _, length = chunk_bounds(spec.shape[spec.dim], parts, batch.index)
                local = part.view(padded).narrow(spec.dim, 0, length).contiguous()
            local = local.to(spec.dtype)  # the variable's own dtype again
            results.append(
                DTensor.from_local(
                    local,
                    ctx.mesh,
                    spec.placements,
                    run_check=False,
                    shape=torch.Size(spec.shape),
                    stride=spec.stride,
                )
            )
        return (None, None, None, None, *results)


def gather_layer_variables(
    batch: BatchGroup,
    mesh: Any,
    batch_axis: int,
    values: Sequence[DTensor],
    gather_dtypes: Sequence[torch.dtype | None] | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[Regather, int], ...]]:
    """Whole plain values of `values` (DTensors split along mesh axis
    `batch_axis`, or replicated along it), gathered together per dtype (one
    all-gather per split variable, see the module); their gradients are
    reduce-scattered (averaged) together per dtype.
    `gather_dtypes`: per value, the dtype it is cast to before its gather
    (None: its own); the whole value has that dtype, its gradient is summed
    in `reduce_dtype` (None: the gradient's) and comes back in the value's.
    With each value, how to gather it again: its bucket's `Regather` and its
    index there (for `ReshardAfterForward.hold`)."""
    wanted = [
        (gather_dtypes[index] if gather_dtypes else None) or value.dtype
        for index, value in enumerate(values)
    ]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(wanted):
        by_dtype.setdefault(dtype, []).append(index)
    outputs: list[Any] = [None] * len(values)
    regathers: list[Any] = [None] * len(values)
    for indices in by_dtype.values():
        specs = []
        for index in indices:
            value = values[index]
            placement = value.placements[batch_axis]
            specs.append(
                _Spec(
                    dim=placement.dim if isinstance(placement, Shard) else None,
                    shape=tuple(value.shape),
                    placements=tuple(value.placements),
                    stride=tuple(value.stride()),
                    dtype=value.dtype,
                    gather_dtype=wanted[index],
                )
            )
        bucket = [values[index] for index in indices]
        wholes = _GatherLayer.apply(batch, mesh, tuple(specs), reduce_dtype, *bucket)
        regather = Regather(batch, specs, bucket)
        for position, (index, whole) in enumerate(zip(indices, wholes, strict=True)):
            outputs[index] = whole
            regathers[index] = (regather, position)
    return tuple(outputs), tuple(regathers)


@dataclass(frozen=True)
class _Packed:
    """A saved tensor that is (a view of) a gathered whole value: where to
    find it again after `Regather.wholes()`."""

    regather: Regather
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ReshardAfterForward:
    """Frees the whole values of a layer's variables when its forward ends
    and gathers them again in its backward (see `Regather`).

    `hold` registers a layer's gathered wholes (by storage) while it runs;
    `release` forgets them when its forward ends. Inside `hooks()`, a tensor
    autograd saves for backward whose storage is a held whole's (the whole
    itself, or a view of it such as a transpose) is saved as a `_Packed`
    handle rather than the tensor, so that nothing keeps the whole alive past
    the layer's forward; any other tensor is saved as is.
    """

    def __init__(self) -> None:
        # The data pointer of a held whole's storage -> (its Regather, index).
        self._held: dict[int, tuple[Regather, int]] = {}

    def hold(
        self,
        wholes: Sequence[torch.Tensor],
        regathers: Sequence[tuple[Regather, int]],
    ) -> None:
        for whole, (regather, index) in zip(wholes, regathers, strict=True):
            # A replicated value is a view of this process' own part, alive
            # anyway: nothing to free.
            if regather.specs[index].dim is not None and whole.numel():
                self._held[whole.untyped_storage().data_ptr()] = (regather, index)

    def release(self, wholes: Sequence[torch.Tensor]) -> None:
        for whole in wholes:
            if whole.numel():
                self._held.pop(whole.untyped_storage().data_ptr(), None)

    def clear(self) -> None:
        self._held.clear()

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (
            not self._held
            or isinstance(tensor, DTensor)
            or tensor.layout is not torch.strided
            or tensor.device.type == "meta"
            or not tensor.numel()
        ):
            return tensor  # not (a view of) a gathered whole value
        held = self._held.get(tensor.untyped_storage().data_ptr())
        if held is None:
            return tensor
        regather, index = held
        if tensor.dtype != regather.specs[index].gather_dtype:
            return tensor  # a reinterpreting view: keep it
        return _Packed(
            regather,
            index,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
        )

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Packed):
            return saved
        # The gathered wholes have the layout of the forward's (the same
        # deterministic gather), so the view's geometry carries over.
        whole = saved.regather.wholes()[saved.index]
        return whole.as_strided(saved.size, saved.stride, saved.offset)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context under which autograd saves held wholes as handles."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _GatherRows(torch.autograd.Function):
    """Every process' rows of a tensor, in process order (see the module)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, batch: BatchGroup, total: int, local: torch.Tensor
    ) -> torch.Tensor:
        parts = batch.size
        ctx.batch, ctx.total = batch, total
        step = math.ceil(total / parts)
        send = _pad_along(local, 0, step).contiguous()
        gathered = send.new_empty((parts * step, *send.shape[1:]))
        _all_gather(gathered, send, group=batch.group)
        # torch.chunk fills every part but the last non-empty one: the whole
        # is the first `total` rows of the padded parts laid end to end.
        return gathered[:total]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        batch = ctx.batch
        start, length = chunk_bounds(ctx.total, batch.size, batch.index)
        return None, None, grad.narrow(0, start, length) * batch.size


def gather_rows(batch: BatchGroup, total: int, local: torch.Tensor) -> torch.Tensor:
    """The whole batch (`total` rows) of a tensor of which this process holds
    its rows, on every process; see the module for its gradient."""
    return _GatherRows.apply(batch, total, local)


class _SumOverProcesses(torch.autograd.Function):
    """A tensor summed over the processes of the batch axis, differentiably
    (the gradient of a sum over processes is the sum of the gradients)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, batch: BatchGroup, tensor: torch.Tensor
    ) -> torch.Tensor:
        ctx.batch = batch
        total = tensor.clone()
        torch_distributed.all_reduce(total, group=batch.group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        total = grad.clone()
        torch_distributed.all_reduce(total, group=ctx.batch.group)
        return None, total


def sum_over_processes(batch: BatchGroup, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the processes along the batch axis (all of them
    get the sum), with its gradient."""
    return _SumOverProcesses.apply(batch, tensor)


def to_full(value: Any) -> Any:
    """A plain tensor with the whole value of `value` (gathered if a DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
