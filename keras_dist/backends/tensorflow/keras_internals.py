"""The Keras private internals the TensorFlow adapter relies on.

`check()` names every one of them, those of `gradients` and `keras_steps`
included, and `tests/test_keras_internals.py` fails loudly when a Keras
release moves any. This module holds the input batches' routing, the
variables moved into a strategy's scope, the metric states summed over the
replicas, the checkpoint helpers, and the workarounds for Keras 3's
multi-worker bugs (keras-team/keras#20585), each reproduced by a test in
`tests/test_multiprocess_tf.py` so it can go when Keras fixes it.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
from tensorflow.python.checkpoint import async_checkpoint_helper
from tensorflow.python.eager import context as tf_context

from keras_dist.common.row_aware import optimizers_of
from keras_dist.keras_compat import backend as keras_backends
from keras_dist.keras_compat.data_adapters import adapter_epoch
from keras_dist.keras_compat.epoch_iterator import EpochRouting

_original_reduce_per_replica = tf_trainer.reduce_per_replica

# Keras' own, for tests that start from a process keras_dist has not patched.
# Wherever this Keras keeps them (`keras_compat.backend`).
TensorFlowTrainer = keras_backends.trainer_class("tensorflow")
TFEpochIterator = keras_backends.epoch_iterator_class("tensorflow")
KERAS_MAYBE_SYMBOLIC_BUILD = TensorFlowTrainer._maybe_symbolic_build

_epochs = EpochRouting(TFEpochIterator)

# Strategies whose step outputs keras_dist already made global (metrics) or
# trimmed to real rows (predictions).
_managed_strategies: list[Any] = []


def check() -> list[str]:
    """Names of the internals that this Keras release no longer has."""
    missing = []
    if not hasattr(TFEpochIterator, "_get_iterator"):
        missing.append("TFEpochIterator._get_iterator")
    iterator = TFEpochIterator(
        x=np.zeros((4, 1)),
        batch_size=2,
        distribute_strategy=tf.distribute.get_strategy(),
    )
    if _keras_tf_datasets.get(iterator.data_adapter, (None,))[0] is not getattr(
        iterator, "_distributed_dataset", None
    ):
        # keras_dist iterates the very dataset Keras built (`keras_tf_dataset`).
        missing.append("TFEpochIterator._distributed_dataset (built once)")
    if not callable(getattr(tf_trainer, "reduce_per_replica", None)):
        missing.append("keras.src.backend.tensorflow.trainer.reduce_per_replica")
    for name in ("_maybe_symbolic_build", "_symbolic_build", "_compute_loss"):
        if not hasattr(TensorFlowTrainer, name):
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


# The dataset each adapter's `TFEpochIterator` built, with TensorFlow's
# global seed at that moment (see `keras_tf_dataset`).
_keras_tf_datasets: weakref.WeakKeyDictionary[Any, tuple[Any, int | None]] = (
    weakref.WeakKeyDictionary()
)


def keras_tf_dataset(data_adapter: Any) -> Any:
    """The adapter's global batches as the `tf.data.Dataset` plain Keras
    iterates: the one its `TFEpochIterator` built (once, every epoch reading
    it again), else one built now and kept for the adapter's later epochs.

    The order is fixed when the dataset is built: Keras 3.16 shuffles arrays
    with a stateless seed taken from the adapter's epoch counter then (so
    plain Keras draws the same order every epoch), Keras 3.15 with op seeds
    drawn from TensorFlow's global seed then (a Keras-built dataset is kept
    only while that seed is unchanged, e.g. not after every process took
    process 0's).
    """
    seed = tf_global_seed()
    try:
        entry = _keras_tf_datasets.get(data_adapter)
    except TypeError:  # not weakly referenceable
        return data_adapter.get_tf_dataset()
    if entry is not None:
        dataset, built_with = entry
        if adapter_epoch(data_adapter) is not None or built_with == seed:
            return dataset
    dataset = data_adapter.get_tf_dataset()
    _keras_tf_datasets[data_adapter] = (dataset, seed)
    return dataset


def _remember_keras_datasets() -> None:
    """Record the plain dataset each `TFEpochIterator` builds (idempotent);
    one built under a strategy is distributed already, and not recorded."""
    original = TFEpochIterator.__init__
    if getattr(original, "_keras_dist_remembers", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        dataset = getattr(self, "_distributed_dataset", None)
        if isinstance(dataset, tf.data.Dataset):
            with contextlib.suppress(TypeError):
                _keras_tf_datasets[self.data_adapter] = (dataset, tf_global_seed())

    __init__._keras_dist_remembers = True  # type: ignore[attr-defined]
    TFEpochIterator.__init__ = __init__


_remember_keras_datasets()


def shuffles_alike_everywhere(data_adapter: Any) -> bool:
    """Whether Keras draws this input's order from the adapter's own epoch
    counter (Keras 3.16's arrays and PyDataset): the same order on every
    process, whatever their generators hold."""
    return adapter_epoch(data_adapter) is not None


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


def maybe_symbolic_build(model: Any, iterator: Any = None, data_batch: Any = None):
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
    TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build


def install_scalar_reads() -> None:
    """`int(v)` and `float(v)` of a scalar Keras variable mirrored by a
    strategy read its value, as for a plain variable (idempotent). Keras'
    `int(self.value)` raises `TypeError` there: tf.distribute's variables
    have no `__int__` (plain Keras under a `MirroredStrategy` too)."""
    variable_class = keras_backends.variable_class("tensorflow")
    if getattr(variable_class.__int__, "_keras_dist", False):
        return
    for name, convert in (("__int__", int), ("__float__", float)):
        original = getattr(variable_class, name)

        def read(self: Any, _original: Any = original, _convert: Any = convert) -> Any:
            value = self.value
            if self.ndim == 0 and isinstance(value, tf.distribute.DistributedValues):
                return _convert(value.read_value())
            return _original(self)

        read._keras_dist = True
        setattr(variable_class, name, read)


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
            if summed_on_read(variable) and value.dtype.is_floating:
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
    _rekey(with_inner_optimizer(optimizer), keys)


def _rekey(optimizers: list[Any], keys: dict[Any, Any]) -> None:
    """Rebuild the indices by which `optimizers` find their variables (their
    TF variables' ids) after those changed (`keys`: old key -> new key)."""
    # A loss-scaling optimizer's inner optimizer applies the updates: its
    # indices are rebuilt too.
    for each in optimizers:
        if not each.built:
            continue
        each._trainable_variables_indices = {
            each._var_key(v): i for i, v in enumerate(each._trainable_variables)
        }
        excluded = getattr(each, "_exclude_from_weight_decay", None)
        if excluded:
            each._exclude_from_weight_decay = {keys.get(k, k) for k in excluded}
        each._exclude_from_weight_decay_cache = {}


# -- an ordinary Keras model between calls -------------------------------------
# On a Keras variable between runs: (the strategy, the TF variable it created).
_MIRRORED = "_keras_dist_mirrored"


def held_optimizers(model: Any) -> list[Any]:
    """Every optimizer `model` holds (a GAN's too), inner optimizers included."""
    return [
        each
        for optimizer in optimizers_of(model)
        for each in with_inner_optimizer(optimizer)
    ]


def _run_variables(model: Any) -> list[Any]:
    variables = all_variables(model)
    for optimizer in held_optimizers(model):
        variables += list(optimizer.variables)
    return list({id(v): v for v in variables}.values())


def _swap_backing(model: Any, swap: Callable[[Any], bool]) -> None:
    """Call `swap(variable)` on each of `model`'s variables; where it changed
    the backing TF variable, rebuild the optimizers' indices."""
    optimizers = held_optimizers(model)
    key_of = optimizers[0]._var_key if optimizers else id
    keys: dict[Any, Any] = {}
    for variable in _run_variables(model):
        if variable._value is None:
            continue
        old_key = key_of(variable)
        if swap(variable):
            keys[old_key] = key_of(variable)
    if keys:
        _rekey(optimizers, keys)


def unmirror_variables(model: Any, strategy: Any) -> None:
    """After a run: every variable `strategy` created for `model` is a plain
    TF variable again, with the value it has (a summed variable: the sum), so
    that the model is an ordinary Keras model between calls (`int(v.value)`,
    `var.assign`, plain Keras `fit`). The mirrored variable is kept for the
    next run under `strategy` (`remirror_variables`), whose compiled steps
    captured it: no tracing again."""

    def swap(variable: Any) -> bool:
        mirrored = variable._value
        if not strategy.extended.variable_created_in_scope(mirrored):
            return False
        value = mirrored.read_value()
        variable.__dict__[_MIRRORED] = (strategy, mirrored)
        variable._value = None
        with tf.init_scope():
            variable._initialize(value)
        return True

    _swap_backing(model, swap)


def remirror_variables(model: Any, strategy: Any) -> None:
    """Before a run under `strategy`: the variables an earlier run under it
    mirrored get that mirrored variable back, holding the value they have now
    (set by the user between the calls, say). Variables mirrored by another
    strategy stay plain (`mirror_variables` creates them again)."""

    def swap(variable: Any) -> bool:
        owner, mirrored = variable.__dict__.pop(_MIRRORED, (None, None))
        if owner is not strategy:
            return False
        value = variable._value.read_value()
        if summed_on_read(variable):
            # The copies' sum is the value: all of it in the first copy.
            for index, copy in enumerate(mirrored.values):
                copy.assign(value if index == 0 else tf.zeros_like(value))
        else:
            mirrored.assign(value)
        variable._value = mirrored
        return True

    _swap_backing(model, swap)


def summed_on_read(variable: Any) -> bool:
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


class MetricStates:
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


def replica_context() -> Any:
    """The replica context when several replicas run this step, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def global_results(model: Any) -> dict[str, Any]:
    """Metric results over every replica's rows, inside a replica."""
    context = replica_context()
    if context is None or not model.metrics_variables:
        return model.get_metrics_result()
    states = MetricStates(model, context)
    return states.results(context.all_reduce(tf.distribute.ReduceOp.SUM, states.flat))
