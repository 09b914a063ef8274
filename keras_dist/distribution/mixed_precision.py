"""Sharded mixed precision: `MixedPrecisionPolicy`, a distribution's
`mixed_precision=`, and the layers it switches for one call.

The three dtypes, as FSDP2's `MixedPrecisionPolicy` names them for PyTorch:

```
parameters   kept as built (float32 under Keras' default and mixed policies):
             the sharded variables, their optimizer slots and the update
compute      what the layers compute in and the weights travel in: a layer
             computes as if built under Keras' `mixed_<compute_dtype>` policy
             (its weights cast where it reads them, its inputs cast on entry);
             a split weight is cast before it is gathered (PyTorch FSDP), or
             where XLA decides (JAX: on TPU it casts before it gathers)
reduce       the dtype gradients are summed over devices in: by default the
             dtype the backward pass computes them in (the compute dtype), as
             FSDP2 does and as XLA and DTensor do; "float32" on PyTorch FSDP
             (each gradient cast up before its reduce-scatter)
```

For one call under the distribution each layer whose variables are float32
and whose policy is a plain (not mixed, not quantized) float policy gets
`mixed_<compute_dtype>`, and its own policy back when the call ends. A layer
already built under a mixed policy keeps it. So does a layer whose policy
holds a quantization mode or is a `DTypePolicyMap`: those are left out and
named in one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat import layers as keras_layers

COMPUTE_DTYPES = ("bfloat16", "float32")
REDUCE_DTYPES = ("bfloat16", "float32")


class MixedPrecisionPolicy:
    """Which dtypes a sharded model computes in and reduces gradients in;
    its parameters keep the dtype they were built in.

    Give it to `kd.FSDP(..., mixed_precision=...)` or
    `kd.ModelParallel(..., mixed_precision=...)`. For the calls under that
    distribution every layer whose variables are float32 computes in
    `compute_dtype`, as if the model had been built under Keras'
    `"mixed_bfloat16"` policy: its variables (and the optimizer's slots and
    update) stay float32, it reads its weights and its inputs cast to
    `compute_dtype`. A layer already built with a mixed policy keeps it. The
    model is the same float32 model again after the call.

    Args:
        compute_dtype: `"bfloat16"` (the default) or `"float32"`. On PyTorch
            FSDP a weight split along the batch axis is cast to its layer's
            compute dtype before it is gathered, halving the all-gather; on
            JAX XLA places the cast (on TPU before the gather). `"float16"`
            is refused: it needs loss scaling, which Keras sets up at
            `compile` for a model built under `"mixed_float16"`; build the
            model that way instead.
        reduce_dtype: the dtype gradients are summed over devices in. None
            (the default): the dtype the backward pass computes them in, the
            compute dtype, as FSDP2 does by default. `"float32"`: summed in
            float32, for accuracy across many devices at twice the
            reduce-scatter's bytes; on PyTorch FSDP along the batch axis only.
            JAX (XLA reduces a gradient where a matmul produces its partial
            sums, in the matmul's dtype), TensorFlow and PyTorch's DTensor
            compute (tensor parallelism) refuse a reduce dtype other than the
            compute dtype with `NotImplementedError`.

    Example:

    >>> policy = keras_dist.MixedPrecisionPolicy("bfloat16")
    >>> policy
    MixedPrecisionPolicy(compute_dtype='bfloat16', reduce_dtype=None)
    """

    def __init__(
        self, compute_dtype: str = "bfloat16", reduce_dtype: str | None = None
    ):
        self.compute_dtype = _dtype(compute_dtype, "compute_dtype", COMPUTE_DTYPES)
        self.reduce_dtype = (
            None
            if reduce_dtype is None
            else _dtype(reduce_dtype, "reduce_dtype", REDUCE_DTYPES)
        )
        if self.reduce_dtype == self.compute_dtype:
            self.reduce_dtype = None  # the default's meaning, spelled out
        if self.reduce_dtype is not None and keras.backend.backend() in (
            "jax",
            "tensorflow",
        ):
            raise NotImplementedError(
                f"reduce_dtype={self.reduce_dtype!r} with compute_dtype="
                f"{self.compute_dtype!r} is not available on "
                f"{keras.backend.backend()}: XLA sums a sharded gradient where a "
                "matmul produces its partial sums, in the matmul's dtype (the "
                "compute dtype), and keras_dist cannot move that sum. Leave "
                "`reduce_dtype` None (gradients reduced in the compute dtype) or "
                "compute in float32."
            )

    def __repr__(self) -> str:
        return (
            f"MixedPrecisionPolicy(compute_dtype={self.compute_dtype!r}, "
            f"reduce_dtype={self.reduce_dtype!r})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MixedPrecisionPolicy)
            and other.compute_dtype == self.compute_dtype
            and other.reduce_dtype == self.reduce_dtype
        )

    def __hash__(self) -> int:
        return hash((self.compute_dtype, self.reduce_dtype))


def _dtype(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    try:
        dtype = keras.backend.standardize_dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype == "float16":
        raise ValueError(
            f"`{name}='float16'` needs loss scaling, which Keras sets up when a "
            "model built under keras.mixed_precision's 'mixed_float16' policy is "
            "compiled (a LossScaleOptimizer). Build and compile the model under "
            "that policy and leave `mixed_precision` out, or use 'bfloat16'."
        )
    if dtype not in allowed:
        raise ValueError(
            f"`{name}` must be one of {list(allowed)}. Received: {name}={value!r}"
        )
    return dtype


def check_mixed_precision(value: Any) -> MixedPrecisionPolicy | None:
    """`value` (a `MixedPrecisionPolicy`, a compute dtype name, or None) as
    a policy."""
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        return MixedPrecisionPolicy(value)
    raise TypeError(
        "`mixed_precision` must be a keras_dist.MixedPrecisionPolicy, a compute "
        f"dtype such as 'bfloat16', or None. Received: mixed_precision={value!r} "
        f"of type {type(value).__name__}"
    )


def _switched_policy(layer: Any, compute_dtype: str) -> tuple[Any, str | None]:
    """The policy `layer` computes under for the call (None: unchanged), and
    why it is left out when it is."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return None, "holds a DTypePolicyMap"
    if getattr(policy, "quantization_mode", None) is not None:
        return None, f"is quantized ({policy.quantization_mode})"
    variable_dtype = policy.variable_dtype
    if variable_dtype != "float32" or policy.compute_dtype != variable_dtype:
        return None, None  # built mixed, or in a dtype of its own: kept
    if compute_dtype == "float32":
        return None, None
    return keras.dtype_policies.DTypePolicy(f"mixed_{compute_dtype}"), None


_warned: set[int] = set()


def compute_in(
    model: Any, policy: MixedPrecisionPolicy, warn: bool = True
) -> Callable[[], None]:
    """Give `model`'s float32 layers `policy`'s compute dtype for one call
    (see the module's docstring); return the undo. Warns once per model
    (process 0: `warn`) naming the layers left out."""
    switched: list[tuple[Any, Any]] = []
    left_out: dict[str, str] = {}
    for layer in keras_layers.layers_of(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        new, why = _switched_policy(layer, policy.compute_dtype)
        if why is not None:
            left_out[layer.name] = why
        if new is not None:
            switched.append((layer, layer.dtype_policy))
            layer.dtype_policy = new
    if left_out and warn and id(model) not in _warned:
        _warned.add(id(model))
        named = ", ".join(f"{name!r} ({why})" for name, why in left_out.items())
        warnings.warn(
            f"mixed_precision={policy!r} leaves these layers of model "
            f"{model.name!r} computing as their own dtype policy says: {named}",
            UserWarning,
            stacklevel=4,
        )

    def undo() -> None:
        for layer, original in reversed(switched):
            layer.dtype_policy = original

    return undo
