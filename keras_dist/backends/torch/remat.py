"""Activation checkpointing on PyTorch with a named policy: the call of a
layer that Keras recomputes whole in the backward pass, run by
`torch.utils.checkpoint` with selective activation checkpointing where the
layer's policy (`keras_compat.remat.policy_of`) is `"dots"`.

    "full"   torch.utils.checkpoint(call, use_reentrant=False), what Keras'
             own `remat` runs: only the call's inputs are kept.
    "dots"   the same, with `context_fn=create_selective_checkpoint_contexts`
             and a policy that keeps the outputs of the matrix products
             without batch dimensions (`aten.mm`, `aten.addmm`: a Dense
             layer's kernel product, a 3-D input's included) and recomputes
             the rest, `aten.bmm` (attention's scores) among it, as JAX's
             `dots_with_no_batch_dims_saveable`.

`"offload"` is refused when the distribution is made (JAX only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.remat import (
    policy_of,
    recompute_whole_calls,
    wrap_recomputed_calls,
)

#: The products `"dots"` keeps: matrix products without batch dimensions.
SAVED_BY_DOTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _save_dots(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in SAVED_BY_DOTS:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint(layer: Any, call: Callable) -> Callable:
    """`call` (`layer`'s) recomputed in the backward pass, keeping what its
    policy names; see the module."""
    policy = policy_of(layer) or "full"
    if policy not in ("full", "dots"):
        raise NotImplementedError(
            f"remat policy {policy!r} of layer {layer.name!r} does not run on "
            "PyTorch: use 'full' or 'dots'."
        )
    extra = {}
    if policy == "dots":
        extra["context_fn"] = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts, _save_dots
        )

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint.checkpoint(
            call, *args, use_reentrant=False, **extra, **kwargs
        )

    return recomputed


def recompute(
    model: Any, distribution: Any, recomputable: Callable | None = None
) -> Callable[[], None]:
    """While in effect, the calls of `model`'s layers that `distribution`'s
    `remat` recomputes run as `recomputable(layer, call)` (under DTensors:
    gathering the layer's split variables again, `ShardedRun.recomputable`),
    by `checkpoint` where its remat has a policy (by Keras' own
    `torch.utils.checkpoint` otherwise); return the undo."""
    remat = getattr(distribution, "remat", None)
    layers = layers_of(model)[1:]
    if remat is None or getattr(remat, "policy", None) in (None, "full"):
        if remat is None or recomputable is None:
            return lambda: None
        return wrap_recomputed_calls(layers, recomputable)

    def policy_checkpoint(layer: Any, call: Callable) -> Callable:
        if recomputable is not None:
            call = recomputable(layer, call)
        return checkpoint(layer, call)

    return recompute_whole_calls(layers, policy_checkpoint)
