"""Activation checkpointing on JAX: the call of a layer that Keras recomputes
whole in the backward pass (`remat=`, or the layer's own `keras.RematScope`),
run by `jax.checkpoint` so that it trains exactly as without it.

Keras' own `jax.checkpoint(layer.call)` makes every argument of the call a
traced value and leaks what the call writes:

- `training=True`, `mask=None`, `use_causal_mask=True` and every other Python
  value reach the call as tracers (Dropout's `if training` fails with
  `TracerBoolConversionError`). Here only the JAX arrays among the arguments
  are traced; every other argument reaches the call as it was passed (static),
  as the train step's own trace sees it without remat.
- A seed generator's next state (Dropout, the noise layers), moving statistics
  (BatchNormalization) and `add_loss` losses are values of the recomputed
  function: kept in Keras' stateless scope they would escape it as tracers.
  Here they leave the function as its outputs (`keras_compat.remat.
  CallEffects`) and are written into the train step's state after it.

So a recomputed Dropout draws its mask from the same seed as without remat,
in the forward pass and again, the same mask, when the backward pass
recomputes it (JAX's random numbers are a pure function of the key), and the
seed generator advances once per call, as without remat:

    args ──split──> arrays (traced) ──┐
            └─────> the rest (static) ┴─> jax.checkpoint(call in its own scope)
                                             │
        outputs <── arrays + static leaves <─┤
        variables' new values, losses <──────┘──> written into the step's scope

A layer's named policy (`keras_compat.remat.policy_of`, from `remat="dots"` or
`"offload"`) is `jax.checkpoint`'s `policy`:

    "full"     nothing saved but the call's inputs (jax.checkpoint's default)
    "dots"     dots_with_no_batch_dims_saveable: the outputs of matrix
               products without batch dimensions (projections) are saved;
               attention's scores (a product with batch dimensions, quadratic
               in the sequence) and all elementwise work are recomputed, as
               MaxText's `remat_policy=minimal`. (`checkpoint_dots` would also
               save the scores, the largest activations of a long sequence.)
    "offload"  offload_dot_with_no_batch_dims("device", "pinned_host"): the
               same products moved to host memory in the forward pass and back
               in backward, as MaxText's `minimal_offloaded`. XLA's CPU
               backend runs the moves as plain copies (device and host memory
               are one there); an accelerator's compiled step holds them in
               host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from keras_dist.keras_compat.remat import CallEffects, policy_of

#: Each named policy's `jax.checkpoint` policy (None: save nothing).
POLICIES: dict[str, Any] = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
}


def _split(leaves: list[Any]) -> list[int]:
    """Where the JAX arrays (traced values included) are among `leaves`."""
    return [index for index, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]


def _filled(leaves: list[Any], where: list[int], arrays: list[Any]) -> list[Any]:
    filled = list(leaves)
    for index, array in zip(where, arrays, strict=True):
        filled[index] = array
    return filled


def checkpoint(layer: Any, call: Callable) -> Callable:
    """`call` (`layer`'s) recomputed in the backward pass, saving what its
    policy names; see the module."""
    policy = POLICIES[policy_of(layer) or "full"]

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        traced = _split(leaves)
        effects = CallEffects(layer)
        # The outputs' structure and static leaves, known once traced.
        outputs_seen: dict[str, Any] = {}

        def pure(arrays: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
            call_args, call_kwargs = jax.tree_util.tree_unflatten(
                tree, _filled(leaves, traced, arrays)
            )
            outputs, values, losses = effects.run(call, *call_args, **call_kwargs)
            out_leaves, out_tree = jax.tree_util.tree_flatten(outputs)
            returned = _split(out_leaves)
            outputs_seen.update(leaves=out_leaves, tree=out_tree, returned=returned)
            return [out_leaves[index] for index in returned], values, losses

        arrays, values, losses = jax.checkpoint(pure, policy=policy)(
            [leaves[i] for i in traced]
        )
        effects.put_back(values, losses)
        return jax.tree_util.tree_unflatten(
            outputs_seen["tree"],
            _filled(outputs_seen["leaves"], outputs_seen["returned"], arrays),
        )

    return recomputed
