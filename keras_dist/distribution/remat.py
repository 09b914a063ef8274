"""Activation checkpointing: a distribution's `remat=`, and the layers of a
model it recomputes in the backward pass during one call.

The modes are Keras' own (`keras.RematScope`): `"full"`, `"activations"`,
`"larger_than"` and `"list_of_layers"`. For a call under the distribution,
keras_dist gives the model's layers the mode they would have had if the model
had been built inside `keras.RematScope(...)`, and takes it back when the call
ends, with two differences that keep training exact:

- A layer whose call updates state (one holding a seed generator: Dropout,
  the noise layers; or trainable and holding non-trainable variables:
  BatchNormalization's moving statistics) is recomputed only where the backend
  recomputes it exactly (`recomputes_state`: JAX, whose recomputed call hands
  its updates out as values and draws the same random numbers again, see
  `backends/jax/remat.py`). On PyTorch the backward pass would run it again,
  advancing its seed generator twice (another mask) and updating its
  statistics twice: there such layers, and the layers holding them, are left
  out and named in one warning; their other sublayers still count.
- `"full"` recomputes the outermost layers that qualify (the model's own
  layers, or a layer's sublayers where it is left out for its state), each as
  one piece: only each piece's inputs are kept for the backward pass, as
  activation checkpointing per block does in torchtitan. A model inside the
  model (a KerasHub backbone inside its task) is not a piece: its own layers
  are, a decoder's blocks. Recomputed whole, it would rebuild all its
  activations at once in the backward pass, and its peak would not fall.
  Keras' scope would also mark every nested layer, recomputing the inner ones
  once more for nothing.

Beside Keras' modes, named policies say what each recomputed piece keeps for
the backward pass (`REMAT_POLICIES`, MaxText's `remat_policy`): `"full"` keeps
only the piece's inputs; `"dots"` also keeps its matrix products without batch
dimensions (the projections: the outputs of Dense and EinsumDense layers, not
attention's scores), recomputing the elementwise work, norms and activation
functions; `"offload"` keeps the same products in host memory, moved there in
the forward pass and back in backward. A policy applies within the pieces
`"full"` recomputes (for a KerasHub model, each decoder block: MaxText's
checkpoint per decoder layer), or those of another mode through
`RematPolicy(policy, mode=..., layer_names=...)`. The backend runs it
(`backends/jax/remat.py`, `backends/torch/remat.py`), reading each layer's
policy (`keras_compat.remat.policy_of`).

A layer that already has its own mode (built under a `keras.RematScope`) keeps
it, and recomputes with no policy. TensorFlow is refused when the
distribution is made (Keras' recompute there cannot run in a compiled step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat import layers as keras_layers
from keras_dist.keras_compat import remat as keras_remat

MODES = ("full", "activations", "larger_than", "list_of_layers")
#: The named policies `remat=` takes (MaxText's `remat_policy`): what each
#: recomputed piece keeps for the backward pass. `"full"`: its inputs only
#: (MaxText `full`); `"dots"`: also its matrix products without batch
#: dimensions (MaxText `minimal`, JAX `dots_with_no_batch_dims_saveable`,
#: PyTorch selective activation checkpointing saving `mm`/`addmm`);
#: `"offload"`: those products in host memory (MaxText `minimal_offloaded`,
#: JAX `offload_dot_with_no_batch_dims`; JAX only).
REMAT_POLICIES = ("full", "dots", "offload")
#: The names `remat=` takes.
_NAMES = ("full", "activations", "larger_than", "dots", "offload")


class RematPolicy(keras.RematScope):
    """A `keras.RematScope` whose recomputed pieces keep what `policy` names.

    `remat="dots"` is `RematPolicy("dots")`: the pieces of mode `"full"`.
    With another mode, the policy applies to the layers that mode recomputes
    whole, such as a list of transformer blocks.

    Args:
        policy: one of `REMAT_POLICIES`: `"full"` (only each piece's inputs
            kept), `"dots"` (also its matrix products without batch
            dimensions) or `"offload"` (those products kept in host memory).
        mode: `"full"`, `"larger_than"` or `"list_of_layers"`: which layers
            are recomputed, as in `keras.RematScope`. (`"activations"`
            recomputes only activation functions, where a policy has nothing
            to choose.)
        output_size_threshold: as in `keras.RematScope`.
        layer_names: as in `keras.RematScope`.

    Example:

    >>> scope = RematPolicy("dots", mode="list_of_layers", layer_names=["block_0"])
    >>> scope.policy, scope.mode
    ('dots', 'list_of_layers')
    """

    def __init__(
        self,
        policy: str,
        mode: str = "full",
        output_size_threshold: int = 1024,
        layer_names: list[str] | None = None,
    ):
        if policy not in REMAT_POLICIES:
            raise ValueError(
                f"`policy` must be one of {list(REMAT_POLICIES)}. Received: "
                f"policy={policy!r}"
            )
        if mode not in ("full", "larger_than", "list_of_layers"):
            raise ValueError(
                "A remat policy applies to the layers recomputed whole: `mode` "
                "must be 'full', 'larger_than' or 'list_of_layers' ('activations' "
                "recomputes only activation functions). Received: "
                f"mode={mode!r}"
            )
        super().__init__(
            mode=mode,
            output_size_threshold=output_size_threshold,
            layer_names=layer_names,
        )
        self.policy = policy

    def __repr__(self) -> str:
        return (
            f"RematPolicy(policy={self.policy!r}, mode={self.mode!r}, "
            f"output_size_threshold={self.output_size_threshold!r}, "
            f"layer_names={self.layer_names!r})"
        )


def policy_of_scope(scope: Any) -> str | None:
    """The named policy of a distribution's `remat` (None: Keras' own scope,
    which keeps each piece's inputs only, as `"full"`)."""
    return getattr(scope, "policy", None)


def check_remat(remat: Any) -> Any:
    """`remat` as a `keras.RematScope` (a `RematPolicy` for a named policy;
    None: no rematerialization)."""
    scope = _as_scope(remat)
    policy = policy_of_scope(scope)
    if policy == "offload" and keras.backend.backend() != "jax":
        raise NotImplementedError(
            "remat='offload' (the saved matrix products moved to host memory) "
            "runs on JAX, whose activation checkpointing offloads them "
            "(memory kind 'pinned_host'). On PyTorch use remat='dots' (the "
            "products kept on the device) or remat='full'. Received: "
            f"remat={remat!r}"
        )
    return scope


def _as_scope(remat: Any) -> Any:
    if remat is None:
        return None
    if keras.backend.backend() == "tensorflow":
        raise NotImplementedError(
            "`remat=` (activation checkpointing, every mode and policy: "
            f"{list(_NAMES)}) runs on JAX and PyTorch ('offload': JAX only). On "
            "TensorFlow, Keras' rematerialization (tf.recompute_grad) fails inside "
            "a compiled step: 'The custom_gradient decorator currently supports "
            "keywords arguments only when eager execution is enabled'. Leave "
            f"`remat` out on TensorFlow. Received: remat={remat!r}"
        )
    if isinstance(remat, str):
        if remat in REMAT_POLICIES and remat != "full":
            return RematPolicy(remat)
        if remat == "list_of_layers":
            raise ValueError(
                "remat='list_of_layers' needs the layers' names: pass "
                "remat=keras.RematScope(mode='list_of_layers', "
                "layer_names=[...])."
            )
        if remat not in MODES:
            raise ValueError(
                f"`remat` must be one of {list(_NAMES)}, a keras.RematScope or "
                f"None. Received: remat={remat!r}"
            )
        return keras.RematScope(mode=remat)
    if isinstance(remat, keras.RematScope):
        if remat.mode is None:
            return None
        if remat.mode == "list_of_layers" and not remat.layer_names:
            raise ValueError(
                "keras.RematScope(mode='list_of_layers') needs `layer_names`, the "
                "names of the layers to recompute. Received: layer_names="
                f"{remat.layer_names!r}"
            )
        return remat
    raise TypeError(
        f"`remat` must be a name ({', '.join(map(repr, _NAMES))}), a "
        f"keras.RematScope or None. Received: remat={remat!r} of type "
        f"{type(remat).__name__}"
    )


def _updates_state(layer: Any) -> bool:
    """Whether `layer`'s own call may update state when training."""
    if keras_layers.seed_generators(layer):
        return True
    return bool(layer.trainable and keras_layers.own_non_trainable_variables(layer))


def _holds_state(layer: Any) -> list[Any]:
    """The layers in `layer` (itself included) whose call updates state."""
    return [inner for inner in keras_layers.layers_of(layer) if _updates_state(inner)]


class RematPlan:
    """Which layers of a model `scope` recomputes: `layers`, and `left_out`,
    the layers holding state (each with the layers in it that update it)."""

    def __init__(self, model: Any, scope: Any, recomputes_state: bool = False):
        self.mode = keras_remat.mode_of_scope(scope)
        self.policy = policy_of_scope(scope)
        self.recomputes_state = recomputes_state
        self.layers: list[Any] = []
        self.left_out: dict[str, list[str]] = {}
        self.kept_own: list[str] = []
        if self.mode.mode == "full":
            self._outermost(keras_layers.sublayers(model))
        else:
            for layer in keras_layers.layers_of(model)[1:]:
                self._consider(layer, descend=False)
        if self.mode.mode == "list_of_layers":
            names = {layer.name for layer in keras_layers.layers_of(model)[1:]}
            unknown = [name for name in self.mode.layer_names if name not in names]
            if unknown:
                raise ValueError(
                    f"remat layer_names {unknown} name no layer of model "
                    f"{model.name!r}. Its layers: {sorted(names)}"
                )
            wanted = set(self.mode.layer_names)
            self.layers = [layer for layer in self.layers if layer.name in wanted]
            self.left_out = {
                name: why for name, why in self.left_out.items() if name in wanted
            }

    def _outermost(self, layers: list[Any]) -> None:
        for layer in layers:
            if any(layer is kept for kept in self.layers):
                continue  # reached twice (a tied embedding, say)
            inner = keras_layers.sublayers(layer)
            if (
                isinstance(layer, keras.Model)
                and inner
                and keras_remat.mode_of(layer) is None
            ):
                # A model inside the model (a KerasHub backbone inside its
                # task): its own layers are the pieces, a decoder's blocks.
                # Recomputed whole, it would rebuild every activation at
                # once in the backward pass, and save nothing at its peak.
                self._outermost(inner)
            elif self._consider(layer, descend=True):
                self._outermost(inner)

    def _consider(self, layer: Any, descend: bool) -> bool:
        """Add `layer` if it qualifies; True when its sublayers are to be
        looked at instead (it holds state)."""
        if isinstance(layer, keras.layers.InputLayer):
            return False
        if keras_remat.mode_of(layer) is not None:
            self.kept_own.append(layer.name)
            return False
        holding = [] if self.recomputes_state else _holds_state(layer)
        if not holding:
            self.layers.append(layer)
            return False
        if not descend or _updates_state(layer):
            self.left_out[layer.name] = [inner.name for inner in holding]
        return descend and not _updates_state(layer)

    def apply(self) -> Callable[[], None]:
        """Give the layers the mode; return what takes it back."""
        for layer in self.layers:
            keras_remat.set_mode(layer, self.mode)
            keras_remat.set_policy(layer, self.policy)

        def undo() -> None:
            for layer in self.layers:
                keras_remat.set_mode(layer, None)
                keras_remat.set_policy(layer, None)

        return undo

    def warning(self, model: Any) -> str | None:
        """What the user is told: the layers left out, or that none qualified."""
        said = []
        if not self.layers:
            said.append(
                f"remat={self.mode.mode!r} recomputes no layer of model "
                f"{model.name!r}: none qualifies"
            )
        if self.left_out:
            left = ", ".join(
                repr(name) if inner == [name] else f"{name!r} (holding {inner})"
                for name, inner in self.left_out.items()
            )
            said.append(
                f"remat leaves out layers whose call updates state (seed "
                f"generators, moving statistics), so that training stays exact: "
                f"{left}"
            )
        return "; ".join(said) or None


_warned: set[tuple[int, int]] = set()


def rematerialize(
    model: Any, scope: Any, warn: bool = True, recomputes_state: bool = False
) -> Callable[[], None]:
    """Give `model`'s layers `scope`'s mode for one call (see the module's
    docstring); return the undo. Warns once per model and scope (process 0:
    `warn`) about the layers it leaves out. `recomputes_state`: whether the
    backend recomputes a layer that updates state exactly (its adapter's
    `recomputes_layer_state`)."""
    plan = RematPlan(model, scope, recomputes_state)
    said = plan.warning(model)
    if said and warn and (id(model), id(scope)) not in _warned:
        _warned.add((id(model), id(scope)))
        warnings.warn(said, UserWarning, stacklevel=4)
    return plan.apply()
