"""BatchNormalization over the global batch on torch, in autograd Functions.

`global_batch_norm` (below) is the whole training-mode normalization of a
channels-last layer in one Function each way, as `nn.SyncBatchNorm` is; it
runs wherever it applies (float32, no mask, no renormalization, channels last,
every row real). `global_moments` gives the statistics alone, for the layers
that keep Keras' own normalization (channels first, say).

`GlobalBatchNorm.moments` (common/) builds the global mean and variance from
backend-neutral ops, and autograd differentiates each of them: on torch a dozen
small ops, and for Keras' channels-last inputs (`(rows, ..., channels)`) each
op broadcasting over the last axis is several times slower on CPU than a
contiguous pass. `global_moments` gives the same statistics from one
`torch.autograd.Function`, the way torch's `SyncBatchNorm` works: forward takes
this process' mean (one sum over the rows) and its sum of squared deviations
from that mean (a second pass, stable far from zero), and combines every
process' count, mean and sum of squared deviations in one all-reduce (each
fills its slot, as in `GlobalBatchNorm`) with the parallel form of the
two-pass variance. Backward sums the gradients of the mean and of
the variance over the processes in one all-reduce and forms the input gradient
in one fused pass (`torch.addcmul`):

    d inputs = (g_mean + 2 * g_var * (inputs - mean)) / count

(the variance's gradient through the mean vanishes: the deviations from the
global mean sum to zero over the global batch). For batches whose rows are all
real (a padded batch takes `GlobalBatchNorm`'s weighted path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_distributed

from keras_dist.backends.torch import process_group


def global_moments(
    inputs: torch.Tensor, axes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and variance of `inputs` over `axes` (every axis but one, the
    channels', axis 0 among them) and over every process' rows, differentiable,
    each of shape `(channels,)` as Keras' `BatchNormalization._moments` returns
    them."""
    channel_axes = [axis for axis in range(inputs.dim()) if axis not in axes]
    if 0 not in axes or len(channel_axes) != 1:
        raise ValueError(
            f"global_moments reduces every axis of inputs of shape "
            f"{tuple(inputs.shape)} but the channels' one, the rows' among "
            f"them; got axes {axes}."
        )
    return _GlobalMoments.apply(inputs, channel_axes[0])


def _global_statistics(
    inputs: torch.Tensor, channel_axis: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean and variance per channel of every process' `inputs` (reduced
    over every axis but `channel_axis`), and the global row count: this
    process' count, mean and sum of squared deviations from that mean (a
    second pass, stable far from zero), every process' in one all-reduce
    (each fills its slot), combined in the parallel form of the two-pass
    variance."""
    channels = inputs.shape[channel_axis]
    axes = tuple(axis for axis in range(inputs.dim()) if axis != channel_axis)
    count = inputs.numel() // channels
    mean = inputs.sum(axes, keepdim=True) / count
    deviations = (inputs - mean).square_().sum(axes)
    local = torch.cat([mean.new_full((1,), float(count)), mean.reshape(-1), deviations])
    each = local.new_zeros((torch_distributed.get_world_size(), local.numel()))
    each[torch_distributed.get_rank()] = local
    torch_distributed.all_reduce(each, group=process_group.group_for(each.device))
    counts, means = each[:, :1], each[:, 1 : 1 + channels]
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    spread = each[:, 1 + channels :].sum(0) + (
        counts * (means - global_mean).square()
    ).sum(0)
    return global_mean, spread / total, total


class _GlobalMoments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, channel_axis: int):
        global_mean, variance, total = _global_statistics(inputs, channel_axis)
        ctx.channel_axis = channel_axis
        ctx.save_for_backward(inputs, global_mean, total)
        return global_mean, variance

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_mean: torch.Tensor, grad_variance: torch.Tensor):
        inputs, mean, total = ctx.saved_tensors
        # Every process' loss reads the global statistics: their gradients
        # summed over the processes, in one all-reduce.
        grads = torch.cat([grad_mean, grad_variance])
        torch_distributed.all_reduce(grads, group=process_group.group_for(grads.device))
        channels = mean.numel()
        slope = grads[channels:] * (2.0 / total)
        offset = grads[:channels] / total - slope * mean
        shape = [1] * inputs.dim()
        shape[ctx.channel_axis] = channels
        # slope * inputs + offset, per channel: one pass.
        grad_inputs = torch.addcmul(offset.view(shape), inputs, slope.view(shape))
        return grad_inputs, None


def global_batch_norm(
    inputs: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNormalization of `inputs` over every axis but the last (the
    channels') and over every process' rows, in one autograd Function: the
    normalized outputs, and the global mean and variance (for the moving
    statistics; not differentiable: Keras assigns them outside the graph).

    What `nn.SyncBatchNorm` does, for Keras' channels-last inputs: forward
    combines every process' (count, mean, sum of squared deviations) in one
    all-reduce, as `global_moments`, and normalizes with torch's own
    batch-norm kernel (`(inputs - mean) * rsqrt(variance + epsilon) * scale +
    offset`, one pass); backward takes this process' `sum(dy)` and
    `sum(dy * normalized)` in one fused pass (torch's batch-norm backward
    kernel), all-reduces them once and forms

        d inputs = scale * rsqrt(variance + epsilon)
                   * (dy - mean(dy) - normalized * mean(dy * normalized))

    (global means) in two passes; `scale`'s and `offset`'s gradients are this
    process' sums (DDP averages them). Against Keras' normalization around
    `global_moments` this is about half the full-size passes each way. For
    batches whose rows are all real.

    torch's kernel normalizes as `inputs * a + (offset - mean * a)` with
    `a = scale * rsqrt(variance + epsilon)`, as `nn.BatchNorm2d` does; Keras
    subtracts the mean first. The two differ by the rounding of `mean * a`
    (float32: about 1e-7 of `|mean| / std`), well inside the parity tests'
    1e-5."""
    if inputs.dim() < 2:
        raise ValueError(
            f"global_batch_norm normalizes inputs with a rows axis and a "
            f"channels axis; got inputs of shape {tuple(inputs.shape)}."
        )
    return _GlobalBatchNorm.apply(inputs, scale, offset, float(epsilon))


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        scale: torch.Tensor | None,
        offset: torch.Tensor | None,
        epsilon: float,
    ):
        channels = inputs.shape[-1]
        # Rows times positions by channels: a view of contiguous inputs.
        rows = inputs.reshape(-1, channels)
        global_mean, variance, total = _global_statistics(rows, 1)
        # torch's batch-norm kernel with the global statistics as its running
        # ones: normalization only, in one pass.
        outputs = torch.nn.functional.batch_norm(
            rows, global_mean, variance, scale, offset, False, 0.0, epsilon
        ).view(inputs.shape)
        ctx.epsilon = epsilon
        ctx.has_offset = offset is not None
        ctx.save_for_backward(rows, global_mean, variance, scale, total)
        ctx.mark_non_differentiable(global_mean, variance)
        return outputs, global_mean, variance

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _mean: Any, _variance: Any):
        rows, mean, variance, scale, total = ctx.saved_tensors
        channels = rows.shape[1]
        grad_rows = grad.reshape(-1, channels)
        # sum(dy * normalized) and sum(dy) per channel, in one fused pass:
        # torch's backward kernel in inference mode gives them as the scale's
        # and offset's gradients.
        _, sum_dy_normalized, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_rows,
            rows,
            None if scale is None else scale.detach(),
            mean,
            variance,
            None,
            None,
            False,
            ctx.epsilon,
            [False, True, True],
        )
        # Every process' loss reads the global statistics: one all-reduce.
        sums = torch.cat([sum_dy, sum_dy_normalized])
        torch_distributed.all_reduce(sums, group=process_group.group_for(sums.device))
        mean_dy = sums[:channels] / total
        mean_dy_normalized = sums[channels:] / total
        inverse_std = torch.rsqrt(variance + ctx.epsilon)
        factor = inverse_std if scale is None else inverse_std * scale.detach()
        # factor * (dy - mean_dy - (inputs - mean) * inverse_std *
        # mean_dy_normalized): factor * dy + slope * inputs + offset.
        slope = -factor * inverse_std * mean_dy_normalized
        intercept = -factor * mean_dy - slope * mean
        grad_inputs = torch.addcmul(intercept, rows, slope).addcmul_(grad_rows, factor)
        return (
            grad_inputs.view(grad.shape),
            None if scale is None else sum_dy_normalized,
            sum_dy if ctx.has_offset else None,
            None,
        )
