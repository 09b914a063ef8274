"""Every Keras private internal the TensorFlow adapter relies on, in one place.

`tests/test_keras_internals.py` calls `check()` and fails loudly when a Keras
release moves any of these. It also holds the workarounds for Keras 3's
multi-worker bugs (keras-team/keras#20585), each reproduced by a test in
`tests/test_multiprocess_tf.py` so it can go when Keras fixes it.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
from tensorflow.python.checkpoint import async_checkpoint_helper
from tensorflow.python.eager import context as tf_context

from keras_dist._keras_compat import (
    EpochRouting,
    GlobalBatchNorm,
    layers_of,
    optimizers_of,
    update_compiled_metrics,
    uses_keras_compute_metrics,
)
from keras_dist.backends.tensorflow import accumulation
from keras_dist.backends.tensorflow.input_adapter import DATA, MASK, SCALE
from keras_dist.custom_steps import (
    STEP_METHODS,
    StepRows,
    current_rows,
    data_for_step,
    global_logs,
    make_rows,
    overridden,
    step_rows,
)
from keras_dist.padding import masked_row_weights

_original_reduce_per_replica = tf_trainer.reduce_per_replica
# Keras' own, for tests that start from a process keras_dist has not patched.
KERAS_MAYBE_SYMBOLIC_BUILD = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
_epochs = EpochRouting(tf_trainer.TFEpochIterator)
# Strategies whose step outputs keras_dist already made global (metrics) or
# trimmed to real rows (predictions).
_managed_strategies: list[Any] = []


def check() -> list[str]:
    """Names of the internals that this Keras release no longer has."""
    missing = []
    if not hasattr(tf_trainer, "TFEpochIterator"):
        missing.append("keras.src.backend.tensorflow.trainer.TFEpochIterator")
    elif not hasattr(tf_trainer.TFEpochIterator, "_get_iterator"):
        missing.append("TFEpochIterator._get_iterator")
    if not callable(getattr(tf_trainer, "reduce_per_replica", None)):
        missing.append("keras.src.backend.tensorflow.trainer.reduce_per_replica")
    for name in ("_maybe_symbolic_build", "_symbolic_build", "_compute_loss"):
        if not hasattr(tf_trainer.TensorFlowTrainer, name):
            missing.append(f"TensorFlowTrainer.{name}")
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    for name in ("_loss_tracker", "_distribute_strategy"):
        if not hasattr(model, name):
            missing.append(f"Trainer.{name}")
    for name in ("_distribution_strategy", "_all_reduce_sum_gradients"):
        if not hasattr(model.optimizer, name):
            missing.append(f"TFOptimizer.{name}")
    # Mixed precision: the inner optimizer sums the gradients (see
    # `fuse_gradient_all_reduce`).
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    inner = getattr(scaled, "inner_optimizer", None)
    if not hasattr(inner, "_all_reduce_sum_gradients"):
        missing.append("LossScaleOptimizer.inner_optimizer._all_reduce_sum_gradients")
    adapter = ArrayDataAdapter(np.zeros((4, 1)), batch_size=2, shuffle=True)
    if getattr(adapter, "_shuffle", None) is not True:
        missing.append("ArrayDataAdapter._shuffle")
    variable = keras.Variable(1.0)
    if not (hasattr(variable, "_initialize") and hasattr(variable, "_value")):
        missing.append("Variable._initialize / Variable._value")
    # Accumulation on per-replica accumulators (`KerasAccumulation`).
    for name in ("_synchronization", "_aggregation"):
        if not hasattr(variable, name):
            missing.append(f"Variable.{name}")
    accumulating = keras.optimizers.SGD(gradient_accumulation_steps=2)
    accumulating.build([variable])
    for name in (
        "_accumulated_gradients",
        "_check_variables_are_known",
        "_iterations",
        "_get_variable_index",
        "_filter_empty_gradients",
        "_clip_gradients",
        "_apply_weight_decay",
        "_backend_update_step",
        "loss_scale_factor",
        "use_ema",
    ):
        if not hasattr(accumulating, name):
            missing.append(f"BaseOptimizer.{name}")
    helper = async_checkpoint_helper.AsyncCheckpointHelper
    if not hasattr(tf.train.Checkpoint(), "_async_checkpointer_impl"):
        missing.append("tf.train.Checkpoint._async_checkpointer_impl")
    if "_async_error" not in helper.__init__.__code__.co_names or not hasattr(
        helper, "_join_async_save_thread"
    ):
        missing.append("AsyncCheckpointHelper._async_error / _join_async_save_thread")
    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        if not hasattr(loss_module, name):
            missing.append(f"keras.src.losses.loss.{name}")
    if not callable(getattr(tf_context, "global_seed", None)):
        missing.append("tensorflow.python.eager.context.global_seed")
    strategy = tf.distribute.get_strategy()
    if not callable(getattr(strategy.extended, "_use_merge_call", None)):
        missing.append("tf.distribute StrategyExtended._use_merge_call")
    return missing


# -- input batches -------------------------------------------------------------
def route_batches(source: Callable[[Any], Any]) -> None:
    """Feed every Keras epoch from `source(data_adapter)` until unrouted."""
    _epochs.route(source)


def unroute_batches() -> None:
    _epochs.unroute()


def reads_again(data_adapter: Any) -> bool:
    """Whether the adapter's input can be read once more (not a one-shot
    Python generator) to compare its first batch between processes."""
    return type(data_adapter).__name__ != "GeneratorDataAdapter"


def shuffles_in_tf(data_adapter: Any) -> bool:
    """Whether Keras shuffles this input with TensorFlow ops seeded from
    TensorFlow's global seed (arrays), not with Python's `random` (PyDataset)."""
    return isinstance(data_adapter, ArrayDataAdapter)


def tf_global_seed() -> int | None:
    """TensorFlow's global seed (`tf.random.set_seed`), None when unset; read
    without drawing an operation seed (`tf.compat.v1.get_seed` would)."""
    return tf_context.global_seed()


def keras_shuffles(data_adapter: Any) -> bool:
    """Whether Keras itself shuffles this input (arrays, `PyDataset`)."""
    return bool(getattr(data_adapter, "_shuffle", False))


# -- Keras 3 multi-worker workarounds (keras-team/keras#20585) -----------------
def _first_replica(value: Any, strategy: Any) -> Any:
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _is_multi_worker(strategy: Any) -> bool:
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
    """Keras' `reduce_per_replica`, fixed for multi-worker strategies.

    Keras reduces scalar logs of a multi-worker strategy with
    `strategy.reduce("MEAN", v, axis=0)`, which fails on scalars; here they are
    reduced over replicas (`axis=None`). Under a strategy keras_dist drives, the
    step outputs are already global (metrics) or real rows only (predictions),
    so logs come from the first local replica and predictions are gathered in
    replica order.
    """
    managed = strategy in _managed_strategies  # strategies compare by identity
    if reduction in ("auto", "mean") and managed:
        return keras.tree.map_structure(lambda v: _first_replica(v, strategy), values)
    if reduction == "concat" and managed and _is_multi_worker(strategy):
        return keras.tree.map_structure(lambda v: strategy.gather(v, axis=0), values)
    if reduction in ("auto", "mean") and _is_multi_worker(strategy):
        return keras.tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values
        )
    return _original_reduce_per_replica(values, strategy, reduction)


def _maybe_symbolic_build(model: Any, iterator: Any = None, data_batch: Any = None):
    """Keras' `_maybe_symbolic_build`, building from one replica's batch.

    Keras averages the per-replica batches across replicas to get a batch to
    build from, a collective that multi-worker strategies fail on; the shapes
    of any one replica's batch build the same model.
    """
    strategy = model._distribute_strategy
    if strategy is None:
        return None
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        # An optimizer from a `compile()` outside the strategy's scope (say,
        # after a keras_dist call mirrored the model) belongs to the default
        # strategy, and building it in this scope raises "Mixing different
        # tf.distribute.Strategy objects". Its variables do not exist yet.
        for each in with_inner_optimizer(optimizer):
            each._distribution_strategy = strategy
    if iterator is not None:
        for _, _, it in iterator:
            data_batch = keras.tree.map_structure(
                lambda v: _first_replica(v, strategy), next(it)
            )
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)
    return None


def install_multi_worker_fixes() -> None:
    """Apply the workarounds for Keras 3's multi-worker `fit` (idempotent)."""
    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def manage(strategy: Any) -> Callable[[], None]:
    """Mark `strategy`'s step outputs as keras_dist's; return the undo."""
    install_multi_worker_fixes()
    _managed_strategies.append(strategy)
    return lambda: _managed_strategies.remove(strategy)


# -- variables -----------------------------------------------------------------
def all_variables(model: Any) -> list[Any]:
    """The model's, its optimizer's and its metrics' variables, once each."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    variables += list(model.metrics_variables)
    return list({id(v): v for v in variables}.values())


def variables_outside(strategy: Any, model: Any) -> list[Any]:
    """The Keras variables of `model` that `strategy` did not create."""
    return [
        v
        for v in all_variables(model)
        if v._value is not None
        and not strategy.extended.variable_created_in_scope(v._value)
    ]


def recreate_in_scope(strategy: Any, variables: list[Any], optimizer: Any) -> None:
    """Create each variable's TF variable again under `strategy`, same value.

    tf.distribute cannot mirror a variable after the fact, so the Keras
    variable gets a new backing variable created in the strategy's scope. The
    optimizer finds its variables by their TF variable's id, so its indices are
    rebuilt too.
    """
    keys: dict[Any, Any] = {}
    with strategy.scope():
        for variable in variables:
            old_key = optimizer._var_key(variable) if optimizer is not None else None
            value = variable._value.read_value()
            variable._value = None
            if _summed_on_read(variable) and value.dtype.is_floating:
                # Every copy of a summed variable starts with the initial
                # value; written from outside a replica, the value is divided
                # among the copies, so their sum is the value read (integers
                # would be truncated).
                variable._initialize(tf.zeros_like(value))
                variable._value.assign(value)
            else:
                variable._initialize(value)
            if optimizer is not None:
                keys[old_key] = optimizer._var_key(variable)
    # A loss-scaling optimizer's inner optimizer applies the updates: its
    # indices are rebuilt too.
    for each in with_inner_optimizer(optimizer):
        if not each.built:
            continue
        each._trainable_variables_indices = {
            each._var_key(v): i for i, v in enumerate(each._trainable_variables)
        }
        excluded = getattr(each, "_exclude_from_weight_decay", None)
        if excluded:
            each._exclude_from_weight_decay = {keys.get(k, k) for k in excluded}
        each._exclude_from_weight_decay_cache = {}


def _summed_on_read(variable: Any) -> bool:
    return variable.synchronization == "on_read" and variable.aggregation == "sum"


def with_inner_optimizer(optimizer: Any) -> list[Any]:
    """`optimizer` and, for a `LossScaleOptimizer` (mixed precision), the
    optimizer it wraps, which has its own strategy and variables."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]


def attach_strategy(model: Any, strategy: Any) -> None:
    """Make `model` (and its optimizer) run under `strategy`."""
    model._distribute_strategy = strategy
    for optimizer in with_inner_optimizer(getattr(model, "optimizer", None)):
        if hasattr(optimizer, "_distribution_strategy"):
            optimizer._distribution_strategy = strategy


def mirror_variables(model: Any, strategy: Any) -> None:
    """Recreate under `strategy` every variable of `model` it did not create."""
    outside = variables_outside(strategy, model)
    if outside:
        recreate_in_scope(strategy, outside, getattr(model, "optimizer", None))


def build_optimizer_in_scope(model: Any, strategy: Any) -> Callable[[], None]:
    """Until the returned undo, `model`'s optimizer builds under `strategy`:
    the model's variables mirrored first, its slots created in the scope.

    Keras builds the optimizer when `fit` starts, in the strategy's scope; a
    callback that builds it earlier (`BackupAndRestore`, to load its slots
    from the backup) does so outside, which raises "Need to be inside `with
    strategy.scope()`".
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return lambda: None
    build = optimizer.build

    def build_in_scope(variables: Any) -> Any:
        mirror_variables(model, strategy)
        with strategy.scope():
            return build(variables)

    # On the instance, past Keras' attribute tracking.
    optimizer.__dict__["build"] = build_in_scope
    return lambda: optimizer.__dict__.pop("build", None)


def prepare(model: Any, strategy: Any, batch: Any) -> None:
    """Every variable of `model` created by `strategy`, and the model, its
    optimizer and metrics built from a batch's specs.

    Variables created outside the strategy's scope are mirrored first, so the
    optimizer slots the build creates sit next to mirrored variables.
    """
    mirror_variables(model, strategy)
    x, y, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
    with strategy.scope():
        if y is None or getattr(model, "optimizer", None) is None:
            # `predict` (no targets) or a model never compiled: the layers
            # only, as Keras' own `predict` builds them (metrics need targets).
            _build_layers(model, x)
        else:
            model._symbolic_build(data_batch=batch)
    mirror_variables(model, strategy)
    optimizer = getattr(model, "optimizer", None)
    if (
        strategy.num_replicas_in_sync > 1
        and optimizer is not None
        and optimizer.built
        and _accumulates_locally(optimizer, model.trainable_variables)
    ):
        accumulate_per_replica(optimizer, strategy)


def _build_layers(model: Any, x: Any) -> None:
    if all(layer.built for layer in layers_of(model)):
        return

    def symbolic(spec: Any) -> Any:
        if spec is None:
            return None
        dtype = keras.backend.standardize_dtype(spec.dtype)
        return keras.KerasTensor(spec.shape, dtype)

    model(keras.tree.map_structure(symbolic, x), training=False)


# -- checkpoints ---------------------------------------------------------------
def tf_variable(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras variable: a `MirroredVariable` or
    `SyncOnReadVariable` once keras_dist mirrored it, else a plain one."""
    value = variable._value
    if value is None:
        raise ValueError(
            f"Variable {variable.path!r} has no value yet; build the model (and "
            "its optimizer) before saving or restoring a checkpoint."
        )
    return value


def take_async_write_error(checkpoint: Any) -> BaseException | None:
    """Why `checkpoint`'s last background write (`enable_async`) failed, or
    None. TensorFlow keeps the error to raise at the next write; taken here,
    it is reported once, by the wait that found the write unfinished."""
    helper = getattr(checkpoint, "_async_checkpointer_impl", None)
    error = getattr(helper, "_async_error", None)
    if error is not None:
        helper._async_error = None
    return error


def close_async_writer(checkpoint: Any) -> None:
    """End `checkpoint`'s background-write thread and free its host copies of
    the variables, which TensorFlow keeps until the process exits."""
    helper = getattr(checkpoint, "_async_checkpointer_impl", None)
    if helper is None:
        return
    atexit.unregister(helper._join_async_save_thread)
    take_async_write_error(checkpoint)  # reported by its own wait, if any
    helper._join_async_save_thread()


# -- steps ---------------------------------------------------------------------
def _split(batch: dict[str, Any]) -> tuple[Any, ...]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch[DATA])
    mask = batch[MASK]
    weights = masked_row_weights(mask, sample_weight)
    # Keras divides each replica's loss by its rows and by the replicas; the
    # padded/real ratio makes the summed gradient the mean over real rows.
    scale = batch[SCALE]
    loss_weights = weights * ops.cast(scale, weights.dtype)
    # This replica's share of the real rows, the loss tracker's weight.
    share = ops.cast(ops.shape(mask)[0], "float32") / scale
    return x, y, mask, weights, loss_weights, share


def _track(model: Any, loss: Any, parts: tuple[Any, ...]) -> None:
    x, y, y_pred, mask, weights, share = parts
    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss), sample_weight=share
    )
    if uses_keras_compute_metrics(model):
        update_compiled_metrics(model, y, y_pred, mask, weights)
    else:
        model.compute_metrics(x, y, y_pred, weights)


class _MetricStates:
    """Every metric state of `model` in one flat vector, to sum over replicas.

    Each replica computes the results from the sums and keeps its own states,
    so the logs are exact global values at every step.
    """

    def __init__(self, model: Any, context: Any):
        self._model = model
        self._replicas = context.num_replicas_in_sync
        self._variables = list(model.metrics_variables)
        self._local = [tf.identity(v.value) for v in self._variables]
        # Metric states are float32 in Keras; sum in float64 only if one is wider.
        wide = any(v.dtype in (tf.float64, tf.int64) for v in self._local)
        dtype = tf.float64 if wide else tf.float32
        self.flat = tf.concat(
            [tf.reshape(tf.cast(v, dtype), [-1]) for v in self._local], 0
        )

    def results(self, summed: Any) -> dict[str, Any]:
        offset = 0
        for variable, value in zip(self._variables, self._local, strict=True):
            size = value.shape.num_elements()
            total = tf.reshape(summed[offset : offset + size], tf.shape(value))
            offset += size
            if variable.aggregation == "mean":
                total = total / self._replicas
            variable.assign(tf.cast(total, variable.dtype))
        results = keras.tree.map_structure(
            tf.identity, self._model.get_metrics_result()
        )
        with tf.control_dependencies(tf.nest.flatten(results)):
            for variable, value in zip(self._variables, self._local, strict=True):
                variable.assign(value)
        return results


def _replica_context() -> Any:
    """The replica context when several replicas run this step, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def _global_results(model: Any) -> dict[str, Any]:
    """Metric results over every replica's rows, inside a replica."""
    context = _replica_context()
    if context is None or not model.metrics_variables:
        return model.get_metrics_result()
    states = _MetricStates(model, context)
    return states.results(context.all_reduce(tf.distribute.ReduceOp.SUM, states.flat))


def _sums_gradients_itself(optimizer: Any) -> bool:
    return optimizer.__dict__.get("_all_reduce_sum_gradients") is _already_summed


def _already_summed(grads_and_vars: Any) -> list[Any]:
    return list(grads_and_vars)


def fuse_gradient_all_reduce(optimizer: Any) -> Callable[[], None]:
    """Let the train step sum the gradients (with the metric states, in one
    all-reduce) instead of the optimizer; return the undo.

    A `LossScaleOptimizer` (mixed precision) then checks the summed gradients
    for inf/nan, the same on every replica: an overflow on one replica makes
    every replica skip the step and halve the loss scale together, as one
    device does. (Left to Keras, it checks the first local replica's own
    gradients and its inner optimizer sums and applies them all: measured,
    another replica's overflow reaches the weights as NaN in one process, and
    in a 2-process job the ranks decide differently and the next all-reduce
    times out.)
    """
    optimizers = with_inner_optimizer(optimizer)
    for each in optimizers:
        object.__setattr__(each, "_all_reduce_sum_gradients", _already_summed)

    def undo() -> None:
        for each in optimizers:
            each.__dict__.pop("_all_reduce_sum_gradients", None)

    return undo


def _apply_accumulating(
    context: Any, optimizer: Any, gradients: list[Any], trainable: list[Any]
) -> None:
    """Apply summed gradients with `gradient_accumulation_steps` in the
    cross-replica context, with Keras' own `apply` (for the optimizers that
    do not accumulate per replica, see `_accumulates_locally`).

    Keras' optimizer chooses between updating the weights and adding to its
    accumulators in a `tf.cond` whose branches update mirrored variables
    through `merge_call`, which TensorFlow cannot run inside a condition in a
    replica (plain Keras under `MirroredStrategy` fails so). Here the whole
    `apply` runs once, in the cross-replica context, on the summed gradients,
    which every replica holds alike (the first local replica's are taken);
    each variable update still reaches every device.
    """

    def apply(strategy: Any, gradients: list[Any]) -> None:
        local = [
            None if g is None else strategy.experimental_local_results(g)[0]
            for g in gradients
        ]
        with _without_merge_call(strategy):
            optimizer.apply_gradients(zip(local, trainable, strict=True))

    context.merge_call(apply, args=(gradients,))


@contextlib.contextmanager
def _without_merge_call(strategy: Any) -> Iterator[None]:
    """Keras' optimizer asks for a `merge_call` when the strategy uses them;
    in the cross-replica context it is not needed (nor possible)."""
    extended = strategy.extended
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        del extended._use_merge_call


def _accumulates_locally(optimizer: Any, trainable: list[Any]) -> bool:
    """Whether `optimizer` accumulates in per-replica accumulators summed once
    per update (`accumulation`).

    Two Keras features keep the sum of every micro-step's gradients and Keras'
    own `apply` (`_apply_accumulating`), with the same results: variables
    overwritten with their gradient (float8 training; Keras accumulates their
    maximum, not their sum) and weights' moving averages (`use_ema`).
    """
    if not optimizer.gradient_accumulation_steps or optimizer.use_ema:
        return False
    return not any(getattr(v, "overwrite_with_gradient", False) for v in trainable)


def accumulate_per_replica(optimizer: Any, strategy: Any) -> None:
    """Back `optimizer`'s gradient accumulators by variables of `strategy`
    that each replica keeps its own copy of and that are summed on read
    (`accumulation`), holding the same sums (idempotent).

    Their creation is kept out of the traced step (`tf.init_scope`): a
    `tf.function` that creates variables is traced a second time.
    """
    shared = [
        a
        for a in optimizer._accumulated_gradients
        if a is not None
        and not (
            _summed_on_read(a) and strategy.extended.variable_created_in_scope(a._value)
        )
    ]
    for accumulator in shared:
        accumulator._synchronization = "on_read"
        accumulator._aggregation = "sum"
    if shared:
        with tf.init_scope():
            recreate_in_scope(strategy, shared, None)


class KerasAccumulation:
    """Keras' own accumulation arithmetic for `accumulation.apply`.

    That of `BaseOptimizer.apply` and `_backend_apply_gradients` (Keras
    3.15): variables it was not built for raise Keras' error, gradients
    missing are left out (with Keras' warning), each micro-gradient is
    divided by `loss_scale_factor`, the update step is the
    k-th micro-step counted by `_iterations` (which counts micro-steps), its
    gradients are the accumulated sums over k, clipped, after Keras' weight
    decay, and the variables' constraints are applied after every micro-step.
    """

    def __init__(self, optimizer: Any, trainable: list[Any]) -> None:
        self._optimizer = optimizer
        self._trainable = trainable
        self._updated: list[Any] = []

    def accumulate(self, strategy: Any, gradients: list[Any]) -> list[tuple[Any, Any]]:
        optimizer = self._optimizer
        if not optimizer.built:
            # Keras' `apply` builds it here; its variables are the strategy's.
            with tf.init_scope(), strategy.scope():
                optimizer.build(self._trainable)
        optimizer._check_variables_are_known(self._trainable)
        present, self._updated = optimizer._filter_empty_gradients(
            gradients, self._trainable
        )
        # Done by `prepare` unless the optimizer was built just now.
        accumulate_per_replica(optimizer, strategy)
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
            for v in self._updated
        ]
        return list(zip(present, [tf_variable(a) for a in accumulators], strict=True))

    def micro_gradient(self, gradient: Any) -> Any:
        scale = self._optimizer.loss_scale_factor
        return gradient if scale is None else gradient / scale

    def is_update_step(self) -> Any:
        optimizer = self._optimizer
        steps = optimizer.gradient_accumulation_steps
        return (optimizer._iterations + 1) % steps == 0

    def update(self, strategy: Any, summed: list[Any]) -> None:
        optimizer = self._optimizer
        steps = optimizer.gradient_accumulation_steps
        gradients = optimizer._clip_gradients([s / steps for s in summed])
        with _without_merge_call(strategy):
            optimizer._apply_weight_decay(self._updated)
            optimizer._backend_update_step(
                gradients, self._updated, optimizer.learning_rate
            )

    def end_micro_step(self) -> None:
        for variable in self._updated:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        self._optimizer._iterations.assign_add(1)


def _check_accumulation(optimizer: Any, where: str) -> None:
    """Raise for `gradient_accumulation_steps` that would be applied inside a
    replica, which TensorFlow cannot run (see `_apply_accumulating`)."""
    accumulating = [
        each.name
        for each in with_inner_optimizer(optimizer)
        if getattr(each, "gradient_accumulation_steps", None)
    ]
    if accumulating:
        raise ValueError(
            f"Optimizer {accumulating[0]!r} has `gradient_accumulation_steps`, "
            f"which keras_dist cannot run on TensorFlow {where} with more than "
            "one replica (its update inside a replica needs a `merge_call` in "
            "a `tf.cond`, which TensorFlow rejects). Leave it out, or train "
            "with Keras' own train_step and an optimizer not wrapped in a "
            "LossScaleOptimizer, or use the JAX or PyTorch backend."
        )


def _apply_summed(model: Any, gradients: list[Any], trainable: list[Any]) -> Any:
    """Sum the gradients and the metric states over replicas in one
    all-reduce, apply the gradients, return the global metric results.

    With `gradient_accumulation_steps` the gradients are, in most cases,
    summed once per update instead (`accumulation`)."""
    context = _replica_context()
    if context is None:
        model.optimizer.apply_gradients(zip(gradients, trainable, strict=True))
        return model.get_metrics_result()
    if _accumulates_locally(model.optimizer, trainable):
        # The gradients stay each replica's own until the update step; the
        # metric states are summed at every step (exact global logs).
        accumulation.apply(
            context, KerasAccumulation(model.optimizer, trainable), gradients
        )
        return _global_results(model)
    states = _MetricStates(model, context) if model.metrics_variables else None
    present = [i for i, g in enumerate(gradients) if g is not None]
    values = [gradients[i] for i in present]
    if states is not None:
        values.append(states.flat)
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    total = list(gradients)
    for index, value in zip(present, summed, strict=False):
        total[index] = value
    if model.optimizer.gradient_accumulation_steps:
        _apply_accumulating(context, model.optimizer, total, trainable)
    else:
        # A LossScaleOptimizer applies its inner optimizer inside the replica.
        _check_accumulation(model.optimizer, "in a LossScaleOptimizer")
        model.optimizer.apply_gradients(zip(total, trainable, strict=True))
    if states is None:
        return model.get_metrics_result()
    return states.results(summed[-1])


# -- the user's own steps --------------------------------------------------------
def user_steps(model: Any) -> set[str]:
    """The steps that run the user's own code, which keras_dist runs as written
    (see `custom_steps`): those `model`'s class overrides, and with its own
    `compute_loss` Keras' train and test steps (which call it), as every loss
    term it adds must be left unscaled and its gradient averaged."""
    steps = set(overridden(model, tf_trainer.TensorFlowTrainer, STEP_METHODS))
    if overridden(model, tf_trainer.TensorFlowTrainer, ("compute_loss",)):
        steps |= {"train_step", "test_step"}
    return steps


_keras_scale_loss = loss_module.scale_loss_for_distribution
_keras_unscale_loss = loss_module.unscale_loss_for_distribution


def _scale_loss(value: Any) -> Any:
    rows = current_rows()
    if rows is not None and rows.unscaled_losses:
        return value
    return _keras_scale_loss(value)


def _unscale_loss(value: Any) -> Any:
    rows = current_rows()
    if rows is not None and rows.unscaled_losses:
        return value
    return _keras_unscale_loss(value)


def install_unscaled_losses() -> None:
    """Keras divides each replica's losses by the replica count (for optimizers
    that sum the gradients); inside a user's step, whose optimizers average
    them instead, losses are left as one device computes them (idempotent)."""
    loss_module.scale_loss_for_distribution = _scale_loss
    loss_module.unscale_loss_for_distribution = _unscale_loss


def _average_over_replicas(gradients: list[Any]) -> list[Any]:
    context = _replica_context()
    present = [i for i, g in enumerate(gradients) if g is not None]
    if context is None or not present:
        return gradients
    averaged = context.all_reduce(
        tf.distribute.ReduceOp.MEAN, [gradients[i] for i in present]
    )
    result = list(gradients)
    for index, value in zip(present, averaged, strict=True):
        result[index] = value
    return result


def _built_outside(build: Callable[..., Any], strategy: Any) -> Callable[..., Any]:
    def build_mirrored(variables: Any) -> Any:
        context = tf.distribute.get_replica_context()
        if context is None:
            return build(variables)

        def in_cross_replica_context(_: Any) -> Any:
            with tf.init_scope(), strategy.scope():
                return build(variables)

        return context.merge_call(in_cross_replica_context)

    return build_mirrored


def average_in_user_steps(model: Any, strategy: Any) -> Callable[[], None]:
    """Every optimizer of `model` runs under `strategy` and leaves the
    gradients' all-reduce to the user's step (`_average_over_replicas`), which
    averages them; return the undo."""
    optimizers = [
        each
        for optimizer in optimizers_of(model)
        for each in with_inner_optimizer(optimizer)
    ]
    if strategy.num_replicas_in_sync > 1:
        for optimizer in optimizers:
            _check_accumulation(optimizer, "in a model's own train_step")
    for optimizer in optimizers:
        optimizer._distribution_strategy = strategy
        # Its step counter and learning rate, created with it, are mirrored
        # (the model's own optimizer is mirrored with the model).
        outside = [
            v
            for v in optimizer.variables
            if v._value is not None
            and not strategy.extended.variable_created_in_scope(v._value)
        ]
        if outside:
            recreate_in_scope(strategy, outside, optimizer)
        object.__setattr__(optimizer, "_all_reduce_sum_gradients", _already_summed)
        if not optimizer.built:
            # Built lazily at its first `apply`, inside the replica step: its
            # variables are created outside the traced function, mirrored.
            object.__setattr__(
                optimizer, "build", _built_outside(optimizer.build, strategy)
            )

    def undo() -> None:
        for optimizer in optimizers:
            optimizer.__dict__.pop("_all_reduce_sum_gradients", None)
            optimizer.__dict__.pop("build", None)

    return undo


def _user_step(model: Any, step: str, batch: dict[str, Any]) -> Any:
    data, mask, scale = batch[DATA], batch[MASK], batch[SCALE]
    share = ops.cast(ops.shape(mask)[0], "float32") / scale
    rows = make_rows(
        model,
        data,
        mask,
        scale,
        share,
        average_gradients=_average_over_replicas,
        unscaled_losses=True,
    )
    with step_rows(rows), GlobalBatchNorm.rows(mask):
        return getattr(type(model), step)(model, data_for_step(data, rows))


def make_steps(model: Any, user_steps: set[str] = frozenset()) -> dict[str, Callable]:
    def user_train_step(batch: Any) -> Any:
        logs = _user_step(model, "train_step", batch)
        return global_logs(model, logs, lambda: _global_results(model))

    def user_test_step(batch: Any) -> Any:
        logs = _user_step(model, "test_step", batch)
        return global_logs(model, logs, lambda: _global_results(model))

    def train_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights, share = _split(batch)
        kwargs = {"training": True} if model._call_has_training_arg else {}
        with tf.GradientTape() as tape:
            with GlobalBatchNorm.rows(mask):
                y_pred = model(x, **kwargs)
            with step_rows(StepRows(model, mask, loss_weights, weights, share)):
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=True
                )
            _track(model, loss, (x, y, y_pred, mask, weights, share))
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        trainable = model.trainable_weights
        if not trainable:
            return _global_results(model)
        gradients = tape.gradient(loss, trainable)
        if _sums_gradients_itself(model.optimizer):
            return _apply_summed(model, gradients, trainable)
        model.optimizer.apply_gradients(zip(gradients, trainable, strict=True))
        return _global_results(model)

    def test_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights, share = _split(batch)
        kwargs = {"training": False} if model._call_has_training_arg else {}
        y_pred = model(x, **kwargs)
        with step_rows(StepRows(model, mask, loss_weights, weights, share)):
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=False
            )
        _track(model, loss, (x, y, y_pred, mask, weights, share))
        return _global_results(model)

    def predict_step(batch: Any) -> Any:
        if "predict_step" in user_steps:
            y_pred = type(model).predict_step(model, batch[DATA])
        else:
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch[DATA])
            kwargs = {"training": False} if model._call_has_training_arg else {}
            y_pred = model(x, **kwargs)
        real = batch[MASK] > 0
        return keras.tree.map_structure(lambda out: tf.boolean_mask(out, real), y_pred)

    return {
        "train_step": user_train_step if "train_step" in user_steps else train_step,
        "test_step": user_test_step if "test_step" in user_steps else test_step,
        "predict_step": predict_step,
    }
