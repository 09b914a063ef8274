"""BatchNormalization's global-batch moments on torch: one autograd Function.

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


class _GlobalMoments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, channel_axis: int):
        world_size = torch_distributed.get_world_size()
        rank = torch_distributed.get_rank()
        channels = inputs.shape[channel_axis]
        axes = tuple(axis for axis in range(inputs.dim()) if axis != channel_axis)
        count = inputs.numel() // channels
        # Two passes, as Keras' own moments makes, and a third: the sum of
        # squared deviations from this process' mean (stable far from zero).
        mean = inputs.sum(axes, keepdim=True) / count
        deviations = (inputs - mean).square_().sum(axes)
        # Every process' statistics in one all-reduce: each fills its slot.
        local = torch.cat(
            [mean.new_full((1,), float(count)), mean.reshape(-1), deviations]
        )
        each = local.new_zeros((world_size, local.numel()))
        each[rank] = local
        torch_distributed.all_reduce(each)
        counts, means = each[:, :1], each[:, 1 : 1 + channels]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        spread = each[:, 1 + channels :].sum(0) + (
            counts * (means - global_mean).square()
        ).sum(0)
        ctx.channel_axis = channel_axis
        ctx.save_for_backward(inputs, global_mean, total)
        return global_mean, spread / total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_mean: torch.Tensor, grad_variance: torch.Tensor):
        inputs, mean, total = ctx.saved_tensors
        # Every process' loss reads the global statistics: their gradients
        # summed over the processes, in one all-reduce.
        grads = torch.cat([grad_mean, grad_variance])
        torch_distributed.all_reduce(grads)
        channels = mean.numel()
        slope = grads[channels:] * (2.0 / total)
        offset = grads[:channels] / total - slope * mean
        shape = [1] * inputs.dim()
        shape[ctx.channel_axis] = channels
        # slope * inputs + offset, per channel: one pass.
        grad_inputs = torch.addcmul(offset.view(shape), inputs, slope.view(shape))
        return grad_inputs, None
