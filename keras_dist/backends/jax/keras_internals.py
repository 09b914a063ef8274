"""Every Keras private internal the JAX adapter relies on, in one place.

`tests/test_keras_internals.py` imports `check()` and fails loudly when a Keras
release moves any of these, so a breakage shows up as one clear test failure.
The arithmetic goes through `keras.ops`; jax itself is touched only where
Keras reads it (`platform_seen_by_keras`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
import numpy as np
from keras import ops
from keras.src import backend as keras_backend
from keras.src.backend.jax import distribution_lib as jax_distribution_lib
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.padding import MaskedBatch, masked_row_weights
from keras_dist.common.step_rows import (
    STEP_METHODS,
    StepRows,
    data_for_step,
    make_rows,
    overridden,
    step_rows,
)
from keras_dist.keras_compat import backend as keras_backends
from keras_dist.keras_compat.epoch_iterator import (
    batches_per_execution,
    reads_one_item_per_execution,
)
from keras_dist.keras_compat.metrics import update_compiled_metrics
from keras_dist.keras_compat.steps import (
    install_cached_steps,
    remove_cached_steps,
    uses_keras_compute_metrics,
)

# Wherever this Keras keeps them (`keras_compat.backend`).
JaxVariable = keras_backends.variable_class("jax")
JAXTrainer = keras_backends.trainer_class("jax")
JAXEpochIterator = keras_backends.epoch_iterator_class("jax")
_original_get_iterator = JAXEpochIterator._get_iterator
_batch_source: list[Callable[[Iterator[Any]], Iterator[Any]]] = []


def check() -> list[str]:
    """Names of the internals that this Keras release no longer has."""
    missing = []
    if not hasattr(JAXEpochIterator, "_get_iterator"):
        missing.append("JAXEpochIterator._get_iterator")
    if not callable(getattr(keras_backends.trainer_module("jax"), "jit", None)):
        # `keras_step_function` records the step Keras jits through it.
        missing.append("keras.src.backend.jax.trainer.jit")
    for name in (
        "compute_loss_and_updates",
        "make_train_function",
        "make_test_function",
        "make_predict_function",
        "train_step",
        "test_step",
        "predict_step",
        "_get_state_sharding_spec",
    ):
        if not hasattr(JAXTrainer, name):
            missing.append(f"JAXTrainer.{name}")
    for name in ("_direct_assign", "_layout"):
        variable = keras.Variable(0.0)
        if not hasattr(variable, name):
            missing.append(f"Variable.{name}")
    if not hasattr(JaxVariable, "__array__"):
        missing.append("JaxVariable.__array__")
    elif type(keras.Variable(0.0)).assign is not JaxVariable.assign:
        # `assign_host_values_through` replaces JaxVariable's `assign`.
        missing.append("JaxVariable.assign (keras.Variable overrides it)")
    if not callable(getattr(jax_distribution_lib, "distribute_tensor", None)):
        missing.append("keras.src.backend.jax.distribution_lib.distribute_tensor")
    jax_core = keras_backends.ops_module("jax")
    if getattr(jax_core, "distribution_lib", None) is not jax_distribution_lib:
        # `JaxVariable._direct_assign` reaches `distribute_tensor` through it.
        missing.append("keras.src.backend.jax.core.distribution_lib")
    if not hasattr(keras_backend, "StatelessScope"):
        missing.append("keras.src.backend.StatelessScope")
    if not hasattr(data_adapter_utils, "unpack_x_y_sample_weight"):
        missing.append("data_adapter_utils.unpack_x_y_sample_weight")
    if reads_one_item_per_execution():
        # Keras 3.16 reads one item per execution; keras_dist hands it lists
        # of single batches, which its multi-step function must run in turn.
        if "PartialBatchList" not in inspect.getsource(
            keras_backends.trainer_module("jax")
        ):
            missing.append("JAX multi-step functions run a PartialBatchList")
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(loss="mse")
    if not hasattr(model, "_loss_tracker"):
        missing.append("Trainer._loss_tracker")
    model.compile(loss="mse", metrics=["mae"], weighted_metrics=["mse"])
    model.evaluate(np.zeros((2, 1)), np.zeros((2, 1)), verbose=0)
    compiled = getattr(model, "_compile_metrics", None)
    for name in ("_flatten_y", "_flat_metrics", "_flat_weighted_metrics", "built"):
        if compiled is None or not hasattr(compiled, name):
            missing.append(f"CompileMetrics.{name}")
    missing += _check_split_at_creation()
    missing += _check_made_through()
    if not callable(getattr(_jax_nn(), "_can_use_flash_attention", None)):
        # `xla_attention_only` answers Keras' choice of attention kernel.
        missing.append("keras.src.backend.jax.nn._can_use_flash_attention")
    return missing


# -- input batches -------------------------------------------------------------
def _patched_get_iterator(epoch_iterator: Any) -> Any:
    if _batch_source:
        batches = _batch_source[-1](epoch_iterator.data_adapter.get_jax_iterator())
        return batches_per_execution(epoch_iterator, batches)
    if getattr(keras.distribution.distribution(), "lays_out_batches_itself", False):
        # A keras_dist policy is global but no run is active (Keras pulling a
        # batch to build the model before the run starts, or a plain `fit`):
        # host arrays, which jit places itself, whatever their batch size.
        return batches_per_execution(
            epoch_iterator, epoch_iterator.data_adapter.get_jax_iterator()
        )
    return _original_get_iterator(epoch_iterator)


def install_batch_routing() -> None:
    """Route Keras JAX epochs through keras_dist while a keras_dist policy is on.

    Keras' own distributions keep Keras' own behaviour.
    """
    JAXEpochIterator._get_iterator = _patched_get_iterator


def route_batches(source: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
    """Send every Keras JAX epoch's batches through `source` until unrouted.

    Keras builds its per-epoch iterator lazily, so routing before the first
    epoch (from `Callback.set_model`) covers the whole `fit`.
    """
    install_batch_routing()
    _batch_source.append(source)


def unroute_batches() -> None:
    if _batch_source:
        _batch_source.pop()


# -- variables -----------------------------------------------------------------
def relayout_variable(variable: Any, layout: Any) -> None:
    """Give an existing variable `layout` and move its value there."""
    variable._layout = layout
    variable._direct_assign(variable.value)


def to_device_memory(variables: list[Any], memory_kind: str) -> None:
    """Each of `variables` laid out in `memory_kind` (pinned host memory)
    laid out in the devices' own memory instead, split as it was."""
    for variable in variables:
        layout = variable._layout
        if getattr(layout, "memory_kind", None) == memory_kind:
            relayout_variable(variable, layout.with_memory_kind("device"))


_original_variable_array = JaxVariable.__array__


def read_variables_through(gather: Callable[[Any], Any]) -> None:
    """Make NumPy reads of Keras JAX variables (`Variable.numpy()`, `np.array`,
    `keras.ops.convert_to_numpy`, hence `get_weights` and every save) go
    through `gather(value)` when it returns an array, e.g. for a value split
    across processes, which JAX cannot fetch on its own (idempotent)."""

    def __array__(self: Any, dtype: Any = None) -> Any:
        gathered = gather(self.value)
        if gathered is None:
            return _original_variable_array(self, dtype)
        return np.asarray(gathered, dtype=dtype)

    __array__._keras_dist_gathers = True  # type: ignore[attr-defined]
    JaxVariable.__array__ = __array__


def place_tensors_through(prepare: Callable[[Any, Any], Any]) -> None:
    """Make Keras' JAX `distribute_tensor` (every assignment of a variable
    that has a layout: `assign`, a metric's reset, `set_weights`, a relayout;
    and `keras.distribution.distribute_tensor`) lay out `prepare(tensor,
    layout)` instead of `tensor` when it returns something, and return
    `tensor` as it is when `prepare` returns `tensor` itself (it is laid out
    already) (idempotent)."""
    original = getattr(
        jax_distribution_lib.distribute_tensor,
        "_keras_dist_original",
        jax_distribution_lib.distribute_tensor,
    )

    def distribute_tensor(tensor: Any, layout: Any) -> Any:
        prepared = prepare(tensor, layout)
        if prepared is tensor:
            return tensor  # laid out already, as `prepare` found
        return original(tensor if prepared is None else prepared, layout)

    distribute_tensor._keras_dist_original = original  # type: ignore[attr-defined]
    jax_distribution_lib.distribute_tensor = distribute_tensor


_jax_core = keras_backends.ops_module("jax")


def split_variables_at_creation(ours: Callable[[Any], bool]) -> None:
    """Under a global distribution that `ours` accepts (keras_dist's), a Keras
    JAX variable whose layout splits it is created split, whatever its size:
    Keras jits its initializer with the layout as the output sharding, so each
    device computes its own part only. Keras itself does that from 250 MiB
    (times the device count) up (`should_shard_at_init`); below, it computes
    the whole value on one device and splits it after, one whole copy of each
    variable on that device on the way. Idempotent."""
    current = _jax_core.should_shard_at_init
    original = getattr(current, "_keras_dist_original", current)

    def should_shard_at_init(init_layout: Any, shape: Any) -> bool:
        if ours(keras.distribution.distribution()) and _splits(init_layout):
            return True
        return original(init_layout, shape)

    should_shard_at_init._keras_dist_original = original  # type: ignore[attr-defined]
    _jax_core.should_shard_at_init = should_shard_at_init


def _splits(sharding: Any) -> bool:
    """Whether a `NamedSharding` splits along a mesh axis of size > 1."""
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return False
    sizes = dict(mesh.shape)
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(name is not None and sizes.get(name, 1) > 1 for name in names):
            return True
    return False


def _check_split_at_creation() -> list[str]:
    function = getattr(_jax_core, "should_shard_at_init", None)
    initialize = getattr(JaxVariable, "_initialize_with_initializer", None)
    # Keras' own, under `make_variables_through`'s.
    initialize = getattr(initialize, "_keras_dist_original", initialize)
    if function is None or initialize is None:
        return [f"{_jax_core.__name__}.should_shard_at_init"]
    if "should_shard_at_init" not in inspect.getsource(initialize):
        return ["JaxVariable._initialize_with_initializer calls should_shard_at_init"]
    return []


def make_variables_through(make: Callable[[Any, Any, Any], Any]) -> None:
    """Have a Keras JAX variable made from an initializer with a layout take
    `make(initializer, shape, dtype, layout)` as its first value when that
    returns an array (a slot in host memory, built there), else Keras' own
    (idempotent)."""
    current = JaxVariable._initialize_with_initializer
    original = getattr(current, "_keras_dist_original", current)

    def _initialize_with_initializer(self: Any, initializer: Any) -> None:
        self._initialize_layout()
        value = None
        if self._layout is not None:
            value = make(initializer, self._shape, self._dtype, self._layout)
        if value is None:
            original(self, initializer)
        else:
            self._value = value

    _initialize_with_initializer._keras_dist_original = original  # type: ignore[attr-defined]
    JaxVariable._initialize_with_initializer = _initialize_with_initializer


def _check_made_through() -> list[str]:
    initialize = getattr(JaxVariable, "_initialize_with_initializer", None)
    initialize = getattr(initialize, "_keras_dist_original", initialize)
    missing = []
    if initialize is None or not hasattr(JaxVariable, "_initialize_layout"):
        return ["JaxVariable._initialize_with_initializer and _initialize_layout"]
    source = inspect.getsource(initialize)
    if "self._value = " not in source or "self._layout" not in source:
        missing.append("JaxVariable._initialize_with_initializer sets self._value")
    return missing


_original_variable_assign = JaxVariable.assign


def assign_host_values_through(place: Callable[[Any, Any, Any], Any]) -> None:
    """Make `assign(value)` of a Keras JAX variable that has a layout (what
    `load_weights`, hence a KerasHub preset, and `set_weights` call with NumPy
    values) assign `place(variable, value, layout)` instead of `value` when it
    returns something (idempotent).

    Keras converts the value with `jnp.asarray` before laying it out, a full
    copy on one device first (keras#21712); `place` can build the laid-out
    array from the host value directly, each device getting only its part."""
    original = getattr(
        JaxVariable.assign, "_keras_dist_original", _original_variable_assign
    )

    def assign(self: Any, value: Any) -> Any:
        layout = self._layout
        if layout is not None:
            placed = place(self, value, layout)
            if placed is not None:
                value = placed
        return original(self, value)

    assign._keras_dist_original = original  # type: ignore[attr-defined]
    JaxVariable.assign = assign


# -- step functions that honour a padding mask ---------------------------------
def _update_metrics(
    model: Any, metrics_variables: Any, loss: Any, real_rows: Any, batch: Any
) -> tuple[Any, list[Any]]:
    x, y, y_pred, mask, weights = batch
    mapping = list(zip(model.metrics_variables, metrics_variables, strict=True))
    with keras_backend.StatelessScope(state_mapping=mapping) as scope:
        # Keras weighs the loss by the padded batch size; only real rows count.
        model._loss_tracker.update_state(loss, sample_weight=real_rows)
        if uses_keras_compute_metrics(model):
            update_compiled_metrics(model, y, y_pred, mask, weights)
            logs = model.get_metrics_result()
        else:
            # A model's own compute_metrics sees the padding as zero weights.
            logs = model.compute_metrics(x, y, y_pred, mask, weights)
    new_values = []
    for ref_variable, value in mapping:
        current = scope.get_current_value(ref_variable)
        new_values.append(value if current is None else current)
    return logs, new_values


def _split(batch: MaskedBatch) -> tuple[Any, Any, Any, Any, Any, Any]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch.data)
    mask = batch.mask
    real_rows = ops.sum(mask)
    weights = masked_row_weights(mask, sample_weight, y)
    # `sum_over_batch_size` divides by the padded size; rescaling the weights
    # makes the loss (and its gradient) the mean over the real rows.
    loss_weights = weights * ops.cast(mask.shape[0] / real_rows, weights.dtype)
    return x, y, weights, loss_weights, real_rows, mask


def masked_train_step(
    model: Any, state: Any, batch: MaskedBatch, value_and_grad: Callable
) -> Any:
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, weights, loss_weights, real_rows, mask = _split(batch)
    grad_fn = value_and_grad(model.compute_loss_and_updates, has_aux=True)
    # The weights `_split` computed (Keras' per-output loss trackers need
    # `real_rows`, see `custom_steps`).
    rows = StepRows(model, mask, loss_weights, weights, real_rows)
    with GlobalBatchNorm.rows(mask), step_rows(rows):
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics_variables,
            x,
            y,
            loss_weights,
            training=True,
            optimizer_variables=optimizer_variables,
        )
    loss, y_pred, non_trainable, metrics_variables = aux
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    logs, metrics_variables = _update_metrics(
        model, metrics_variables, loss, real_rows, (x, y, y_pred, mask, weights)
    )
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def masked_test_step(model: Any, state: Any, batch: MaskedBatch) -> Any:
    trainable, non_trainable, metrics_variables = state
    x, y, weights, loss_weights, real_rows, mask = _split(batch)
    # The weights `_split` computed (Keras' per-output loss trackers need
    # `real_rows`, see `custom_steps`).
    rows = StepRows(model, mask, loss_weights, weights, real_rows)
    with step_rows(rows):
        _, aux = model.compute_loss_and_updates(
            trainable,
            non_trainable,
            metrics_variables,
            x,
            y,
            loss_weights,
            training=False,
        )
    loss, y_pred, non_trainable, metrics_variables = aux
    logs, metrics_variables = _update_metrics(
        model, metrics_variables, loss, real_rows, (x, y, y_pred, mask, weights)
    )
    return logs, (trainable, non_trainable, metrics_variables)


def install_steps(
    model: Any,
    distribution: Any,
    trim_outputs: Callable[[Any, Any], Any],
    value_and_grad: Callable,
) -> None:
    """Make `model`'s steps accept `MaskedBatch` and trim padded predictions.

    Instance attributes shadow the class' methods for as long as the
    distribution is active; `remove_steps` deletes them again. The compiled
    functions of the previous run are reused when nothing they depend on
    changed, so calling `fit` in a loop does not compile every time.
    """
    install_cached_steps(
        model,
        distribution,
        lambda: _masked_steps(model, trim_outputs, value_and_grad),
    )


def user_steps(model: Any) -> set[str]:
    """The step methods `model`'s class overrides: its own code, which keras_dist
    runs as written (an uneven batch is laid out whole rather than padded). An
    own `compute_loss` makes Keras' train and test steps (which call it) the
    user's: a term it adds over the predictions must not see padding rows."""
    names = (*STEP_METHODS, "compute_loss_and_updates")
    steps = set(overridden(model, JAXTrainer, names))
    if overridden(model, JAXTrainer, ("compute_loss",)):
        steps |= {"train_step", "test_step"}
    return steps


def _user_step(model: Any, step: Callable, state: Any, batch: MaskedBatch) -> Any:
    """The user's own step on a padded batch (each process read its own rows):
    the padding reaches it as zero sample weights (see `custom_steps`)."""
    real_rows = ops.sum(batch.mask)
    scale = batch.mask.shape[0] / real_rows
    rows = make_rows(model, batch.data, batch.mask, scale, real_rows)
    with step_rows(rows), GlobalBatchNorm.rows(batch.mask):
        return step(model, state, data_for_step(batch.data, rows))


def _masked_steps(
    model: Any, trim_outputs: Callable[[Any, Any], Any], value_and_grad: Callable
) -> dict[str, Callable]:
    cls = type(model)
    custom = user_steps(model)

    def train_step(state: Any, data: Any) -> Any:
        if not isinstance(data, MaskedBatch):
            return cls.train_step(model, state, data)
        if custom & {"train_step", "compute_loss_and_updates"}:
            return _user_step(model, cls.train_step, state, data)
        return masked_train_step(model, state, data, value_and_grad)

    def test_step(state: Any, data: Any) -> Any:
        if not isinstance(data, MaskedBatch):
            return cls.test_step(model, state, data)
        if custom & {"test_step", "compute_loss_and_updates"}:
            return _user_step(model, cls.test_step, state, data)
        return masked_test_step(model, state, data)

    def predict_step(state: Any, data: Any) -> Any:
        if isinstance(data, MaskedBatch):
            data = data.data
        return cls.predict_step(model, state, data)

    def make_predict_function(force: bool = False) -> Any:
        cls.make_predict_function(model, force=force)
        compiled = model.predict_function
        if getattr(compiled, "_keras_dist_trims", False):
            return compiled

        def predict_function(state: Any, iterator: Any) -> Any:
            outputs, state = compiled(state, iterator)
            return trim_outputs(outputs, iterator), state

        predict_function._keras_dist_trims = True
        model.predict_function = predict_function
        return predict_function

    return {
        "train_step": train_step,
        "test_step": test_step,
        "predict_step": predict_step,
        "make_predict_function": make_predict_function,
    }


_STEP_KINDS = ("train", "test", "predict")


@contextlib.contextmanager
def platform_seen_by_keras(devices: list[Any]) -> Iterator[None]:
    """Keras' JAX code as it runs on `devices`' platform while a step is
    traced for them on another host: Keras chooses some ops by the default
    device's platform (`jax.devices()[0].platform`, `jax.default_backend()`:
    the TPU splash-attention kernel, the CPU-only paths), so a step traced on
    a CPU host for a TPU slice would otherwise be the CPU's program. Only the
    calls without arguments answer for `devices`."""
    platform = devices[0].platform
    original_devices, original_backend = jax.devices, jax.default_backend

    def seen_devices(backend: Any = None) -> Any:
        return list(devices) if backend is None else original_devices(backend)

    def seen_backend() -> str:
        return platform

    jax.devices, jax.default_backend = seen_devices, seen_backend
    try:
        yield
    finally:
        jax.devices, jax.default_backend = original_devices, original_backend


def _jax_nn() -> Any:
    """Keras' JAX `nn` ops module, where the installed Keras has it:
    `keras.src.backend.jax.ops.nn` (Keras 3.16), `keras.src.backend.jax.nn`
    (Keras 3.15). Imported when first needed."""
    for name in ("keras.src.backend.jax.ops.nn", "keras.src.backend.jax.nn"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def xla_attention_only(sequence_axis: str) -> Callable[[], None]:
    """Make Keras' JAX `dot_product_attention` choose XLA's attention where
    its caller leaves the choice to it (`flash_attention=None`, as KerasHub's
    Llama, Mistral, Gemma and Qwen call it), until what is returned undoes
    it. Keras otherwise picks cuDNN's fused attention on a GPU that has it,
    whose partitioning refuses a query split along the sequence, and the
    Splash kernel on a TPU, which XLA cannot partition; it reads
    `keras.config.is_flash_attention_enabled()` only where a layer is made,
    not at the op. An explicit `flash_attention=True` (Keras then asks with
    `raise_error=True`) raises a `ValueError` naming `sequence_axis`: no flash
    kernel can be split along the sequence."""
    jax_nn = _jax_nn()
    original = jax_nn._can_use_flash_attention

    def can_use(query: Any, key: Any, value: Any, bias: Any, raise_error=False):
        if raise_error:
            raise ValueError(
                "keras.ops.dot_product_attention was called with "
                "flash_attention=True during a call whose distribution splits "
                f"each sequence along {sequence_axis!r} (sequence_axis=): the "
                "flash kernels (Splash on TPU, cuDNN on GPU) cannot be split "
                "along the sequence. Pass flash_attention=None (XLA's attention "
                "runs) or False there, or drop sequence_axis. Received: "
                f"query shape {tuple(query.shape)}"
            )
        return False

    jax_nn._can_use_flash_attention = can_use

    def undo() -> None:
        jax_nn._can_use_flash_attention = original

    return undo


def keras_step_function(model: Any, kind: str, state_shardings: tuple) -> Any:
    """The jitted step Keras' `make_{kind}_function` builds for `model` (the
    one `fit`, `evaluate` or `predict` runs, with Keras' own donation and
    output shardings), for a state laid out as `state_shardings` (the four
    lists `_get_state_sharding_spec` returns: trainable, non-trainable,
    optimizer and metrics variables). The model's variables need no value:
    the shardings are given, not read from them. The first function Keras
    jits there is the step (Keras 3.15 jits it in `make_*_function`, 3.16 in
    `_make_function`, before the scan over `steps_per_execution` steps); the
    model keeps the step functions it had."""
    if kind not in _STEP_KINDS:
        raise ValueError(f"`kind` must be one of {_STEP_KINDS}. Received: {kind!r}")
    names = (f"{kind}_function", "_get_state_sharding_spec")
    saved = {name: model.__dict__[name] for name in names if name in model.__dict__}
    module = keras_backends.trainer_module("jax")
    original_jit = module.jit
    captured: list[Any] = []

    def recording_jit(function: Any, *args: Any, **kwargs: Any) -> Any:
        jitted = original_jit(function, *args, **kwargs)
        captured.append(jitted)
        return jitted

    model._get_state_sharding_spec = lambda: state_shardings
    module.jit = recording_jit
    try:
        getattr(model, f"make_{kind}_function")(force=True)
    finally:
        module.jit = original_jit
        for name in names:
            model.__dict__.pop(name, None)
        model.__dict__.update(saved)
    if not captured:
        raise ValueError(
            f"Keras made model {model.name!r}'s {kind} function without jit "
            "(run_eagerly=True or jit_compile=False): there is no compiled step "
            "to plan. Compile the model with jit_compile=True."
        )
    return captured[0]


def remove_steps(model: Any) -> None:
    """Put Keras' own steps back, keeping the compiled ones for the next run."""
    remove_cached_steps(model)


__all__ = [
    "assign_host_values_through",
    "check",
    "install_steps",
    "keras_step_function",
    "platform_seen_by_keras",
    "place_tensors_through",
    "read_variables_through",
    "relayout_variable",
    "remove_steps",
    "route_batches",
    "split_variables_at_creation",
    "to_device_memory",
    "unroute_batches",
    "xla_attention_only",
]
