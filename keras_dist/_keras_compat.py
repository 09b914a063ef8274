"""The backend-neutral Keras details keras_dist relies on, in one place.

`tests/test_keras_internals.py` checks each of them, so a Keras release that
moves one fails that test loudly instead of breaking users quietly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras.src.trainers import compile_utils

from keras_dist.custom_steps import current_rows

# Keras does not export the policies' base class; it is the common base of
# its DataParallel and ModelParallel.
KerasDistribution = keras.distribution.DataParallel.__mro__[1]


@contextlib.contextmanager
def numpy_random_stream(stream: np.random.RandomState | None) -> Iterator[None]:
    """Make NumPy's global generator draw from `stream` inside the block.

    Keras' array adapter shuffles with `np.random.permutation` when an epoch's
    iterator starts; running it inside one stream seeded alike on every process
    gives every process the same global permutation, new each epoch.
    """
    if stream is None:
        yield
        return
    saved = np.random.get_state()
    np.random.set_state(stream.get_state())
    try:
        yield
    finally:
        stream.set_state(np.random.get_state())
        np.random.set_state(saved)


# Callbacks that only write files; in a multi-process job only process 0 runs
# them. (ModelCheckpoint is not among them: reading arrays that span processes
# is collective, so every process must save; see `keras_dist.saving`.)
FILE_WRITING_CALLBACKS = (
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
)


def _do_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def silence_callbacks(
    classes: tuple[type, ...], also: tuple[str, ...] = ()
) -> Callable[[], None]:
    """Make every callback of `classes` do nothing in this process (its `on_*`
    methods and the methods named in `also`); return the function that
    restores them.

    Called on processes other than 0 for the duration of a distributed call, so
    progress, logs and checkpoints of replicated state appear once. Patching the
    classes rather than a setting also covers the hooks Keras runs on its
    callback threads, where thread-local settings do not reach.
    """
    saved: list[tuple[type, str, Any]] = []
    for cls in classes:
        for name in dir(cls):
            if (name.startswith("on_") or name in also) and callable(
                getattr(cls, name)
            ):
                saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _do_nothing)

    def restore() -> None:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)

    return restore


# -- one writer in a multi-process job --------------------------------------------
# Keras' functions behind `Model.save`, `Model.save_weights`, `keras.saving.*`
# and `keras.models.save_model` (the `Model` methods call them by module).
SAVING_FUNCTIONS = ("save_model", "save_weights")


def wrap_saving_functions(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]):
    """Replace Keras' `save_model(model, filepath, ...)` and
    `save_weights(model, filepath, ...)` with `wrap(original)`, wherever Keras
    exports them (idempotent)."""
    from keras.src.saving import saving_api  # noqa: PLC0415

    for name in SAVING_FUNCTIONS:
        original = getattr(saving_api, name)
        if getattr(original, "_keras_dist_wrapped", False):
            continue
        wrapped = wrap(original)
        wrapped._keras_dist_wrapped = True
        setattr(saving_api, name, wrapped)
        for namespace in (keras.saving, keras.models):
            if getattr(namespace, name, None) is original:
                setattr(namespace, name, wrapped)


def tolerate_existing_directories() -> None:
    """Let Keras' `file_utils.makedirs` accept a directory that appeared after
    its caller checked (idempotent).

    `ModelCheckpoint` creates its directory when `exists()` says it is not
    there; every process of a job does that at the same step, and all but the
    first would fail with `FileExistsError`.
    """
    from keras.src.utils import file_utils  # noqa: PLC0415

    original = file_utils.makedirs
    if getattr(original, "_keras_dist_wrapped", False):
        return

    def makedirs(path: Any) -> Any:
        try:
            return original(path)
        except FileExistsError:
            if file_utils.isdir(path):
                return None
            raise

    makedirs._keras_dist_wrapped = True
    file_utils.makedirs = makedirs


def one_writer_backup_and_restore(
    is_writer: Callable[[], bool], barrier: Callable[[str], None]
) -> None:
    """Make `keras.callbacks.BackupAndRestore` write and delete its backup on
    the writer process only, the others waiting at `barrier` until it is done
    (idempotent).

    Every process still reads the backup when training starts (the directory
    must be one they all see) and still calls `save_weights` when the writer
    does, so that reads of variables spanning processes, which are collective,
    happen on all of them.
    """
    from keras.src.utils import file_utils  # noqa: PLC0415

    cls = keras.callbacks.BackupAndRestore
    if getattr(cls._save_model, "_keras_dist_wrapped", False):
        return
    save_backup, delete_backup = cls._save_model, cls.on_train_end

    def on_train_begin(self: Any, logs: Any = None) -> None:
        # Keras' own, with the repair of an unreadable backup from the previous
        # one done by the writer alone.
        try:
            self._load_model()
        except OSError:
            if not file_utils.exists(self._prev_weights_path):
                raise
            if is_writer():
                file_utils.copy(self._prev_weights_path, self._weights_path)
                if file_utils.exists(self._prev_training_metadata_path):
                    file_utils.copy(
                        self._prev_training_metadata_path,
                        self._training_metadata_path,
                    )
                elif file_utils.exists(self._training_metadata_path):
                    file_utils.remove(self._training_metadata_path)
            barrier(f"BackupAndRestore repair {self.backup_dir}")
            self._load_model()

    def _save_model(self: Any) -> None:
        if is_writer():
            save_backup(self)
        else:
            self.model.save_weights(self._weights_path, overwrite=True)
        barrier(f"BackupAndRestore save {self.backup_dir}")

    def on_train_end(self: Any, logs: Any = None) -> None:
        if is_writer():
            delete_backup(self, logs)
        barrier(f"BackupAndRestore delete {self.backup_dir}")

    for function in (on_train_begin, _save_model, on_train_end):
        function._keras_dist_wrapped = True  # type: ignore[attr-defined]
        setattr(cls, function.__name__, function)


# Keras' calls that hand the model to their callbacks (`CallbackList.set_model`).
MODEL_CALLS = ("fit", "evaluate", "predict")


def run_model_calls_within(around: Callable[[Any], Any]) -> None:
    """Run every model's `fit`, `evaluate` and `predict` inside the context
    manager `around(model)`, from now on (idempotent).

    Keras tells callbacks when a call ends but not when it raises, so what a
    callback switched on for the call would outlive a call that raised;
    `around` can end it in its `finally`. Wrapping `keras.Model` covers
    Sequential, functional and subclassed models, and overrides that call
    `super().fit(...)`.
    """
    for name in MODEL_CALLS:
        original = getattr(keras.Model, name)
        if getattr(original, "_keras_dist_around", None) is not None:
            continue
        setattr(keras.Model, name, _call_within(original, around))


def _call_within(
    original: Callable[..., Any], around: Callable[[Any], Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with around(self):
            return original(self, *args, **kwargs)

    call._keras_dist_around = around  # type: ignore[attr-defined]
    return call


def update_compiled_metrics(
    model: Any, y: Any, y_pred: Any, mask: Any, weights: Any
) -> None:
    """`compute_metrics`, but padded rows count in neither kind of metric.

    Keras hands `sample_weight` only to `weighted_metrics`; `metrics` ignore it
    and would count the padding, so they get the mask as their weight.
    """
    compiled = model._compile_metrics
    if compiled is not None:
        if not compiled.built:
            compiled.build(y, y_pred)
        flat_true = compiled._flatten_y(y)
        flat_pred = compiled._flatten_y(y_pred)
        for metric, y_true, y_out in zip(
            compiled._flat_metrics, flat_true, flat_pred, strict=True
        ):
            if metric:
                metric.update_state(y_true, y_out, sample_weight=mask)
        for metric, y_true, y_out in zip(
            compiled._flat_weighted_metrics, flat_true, flat_pred, strict=True
        ):
            if metric:
                metric.update_state(y_true, y_out, sample_weight=weights)


# -- Keras' own pieces inside a keras_dist step (see `custom_steps`) -----------
# Installed once, for good: outside a keras_dist step (`current_rows()` is None)
# they are Keras' own methods, so plain Keras is never affected.
_KerasCompileMetrics = compile_utils.CompileMetrics
_keras_mean_update_state = keras.metrics.Mean.update_state
_keras_compile_metrics_update_state = _KerasCompileMetrics.update_state
_keras_wrapper_update_state = keras.metrics.MeanMetricWrapper.update_state


def _is_loss_tracker(model: Any, metric: Any) -> bool:
    """Whether `metric` is one of the Mean metrics in which Keras tracks the
    loss (the total, and each output's) weighted by the batch's row count."""
    if metric is getattr(model, "_loss_tracker", None):
        return True
    compile_loss = getattr(model, "_compile_loss", None)
    return compile_loss is not None and any(
        metric is tracker for tracker in compile_loss.metrics
    )


def _metric_weights(rows: Any, sample_weight: Any) -> Any:
    """A step's own metric given the step's loss weights (scaled by padded/real
    rows for the loss' sake) counts each real row once: the unscaled ones."""
    if rows is not None and sample_weight is rows.loss_weights:
        return rows.metric_weights
    return sample_weight


def _mean_update_state(self: Any, values: Any, sample_weight: Any = None) -> Any:
    rows = current_rows()
    sample_weight = _metric_weights(rows, sample_weight)
    # Keras weighs a batch's loss by its row count (an int, or a scalar tensor
    # on TensorFlow): the padded count in a padded batch, where only the real
    # rows should count.
    if (
        rows is not None
        and sample_weight is not None
        and len(getattr(sample_weight, "shape", ())) == 0
        and _is_loss_tracker(rows.model, self)
    ):
        sample_weight = rows.tracked_rows
    return _keras_mean_update_state(self, values, sample_weight=sample_weight)


def _wrapper_update_state(
    self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None
) -> Any:
    sample_weight = _metric_weights(current_rows(), sample_weight)
    return _keras_wrapper_update_state(
        self, y_true, y_pred, sample_weight=sample_weight
    )


def _compile_metrics_update_state(
    self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None
) -> Any:
    rows = current_rows()
    if rows is None or self is not getattr(rows.model, "_compile_metrics", None):
        return _keras_compile_metrics_update_state(
            self, y_true, y_pred, sample_weight=sample_weight
        )
    # Compiled metrics (`metrics` too, which Keras gives no weight) count only
    # the real rows.
    return update_compiled_metrics(
        rows.model, y_true, y_pred, rows.mask, rows.metric_weights
    )


def install_row_aware_metrics() -> None:
    """Make Keras' loss trackers and compiled metrics count only the real rows
    of a keras_dist step's batch (idempotent)."""
    keras.metrics.Mean.update_state = _mean_update_state
    keras.metrics.MeanMetricWrapper.update_state = _wrapper_update_state
    _KerasCompileMetrics.update_state = _compile_metrics_update_state


def inject_loss_weights(model: Any) -> Callable[[], None]:
    """Make `model.compute_loss` called without `sample_weight` inside a
    keras_dist step use the step's loss weights (padding rows 0); return the
    undo. The model's own `compute_loss` runs, with those weights."""
    method = type(model).compute_loss
    if "sample_weight" not in inspect.signature(method).parameters:
        return lambda: None

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        rows = current_rows()
        if rows is not None and rows.model is model:
            if len(args) >= 4:
                if args[3] is None:
                    args = (*args[:3], rows.loss_weights, *args[4:])
            elif kwargs.get("sample_weight") is None:
                kwargs["sample_weight"] = rows.loss_weights
        return method(model, *args, **kwargs)

    object.__setattr__(model, "compute_loss", compute_loss)
    return lambda: model.__dict__.pop("compute_loss", None)


def optimizers_of(model: Any) -> list[Any]:
    """Every optimizer `model` holds as an attribute (`optimizer`, and e.g. a
    GAN's `d_optimizer` and `g_optimizer`), once each."""
    found: list[Any] = []
    for value in list(vars(model).values()):
        if isinstance(value, keras.optimizers.Optimizer) and not any(
            value is other for other in found
        ):
            found.append(value)
    return found


def average_gradients_in(optimizers: list[Any]) -> Callable[[], None]:
    """Make each optimizer's `apply` (and so `apply_gradients`) average the
    gradients over the replicas first, inside a keras_dist step whose rows say
    how (`StepRows.average_gradients`); return the undo."""
    for optimizer in optimizers:
        method = type(optimizer).apply

        def apply(
            grads: Any,
            trainable_variables: Any = None,
            _optimizer: Any = optimizer,
            _method: Callable[..., Any] = method,
        ) -> Any:
            rows = current_rows()
            if rows is not None and rows.average_gradients is not None:
                grads = rows.average_gradients(list(grads))
            return _method(_optimizer, grads, trainable_variables)

        object.__setattr__(optimizer, "apply", apply)

    def undo() -> None:
        for optimizer in optimizers:
            optimizer.__dict__.pop("apply", None)

    return undo


class EpochRouting:
    """Keras builds each epoch's batches with `iterator_class._get_iterator`;
    while a source is routed, they come from `source(data_adapter)` instead
    (the latest routed source wins; unrouting the last restores Keras')."""

    def __init__(self, iterator_class: type):
        self._class = iterator_class
        self._original = iterator_class._get_iterator
        self._sources: list[Callable[[Any], Any]] = []

    def route(self, source: Callable[[Any], Any]) -> None:
        sources = self._sources

        def get_iterator(epoch_iterator: Any) -> Any:
            return sources[-1](epoch_iterator.data_adapter)

        self._class._get_iterator = get_iterator
        sources.append(source)

    def unroute(self) -> None:
        if self._sources:
            self._sources.pop()
        if not self._sources:
            self._class._get_iterator = self._original


COMPILED_FUNCTIONS = ("train_function", "test_function", "predict_function")
_INSTALLED_STEPS = "_keras_dist_steps"


def install_steps(model: Any, steps: dict[str, Callable[..., Any]]) -> None:
    """Shadow `model`'s step methods with `steps` (instance attributes) until
    `remove_steps`, and drop the compiled functions built from the old ones."""
    for name, function in steps.items():
        object.__setattr__(model, name, function)
    model.__dict__[_INSTALLED_STEPS] = tuple(steps)
    reset_compiled_functions(model)


def remove_steps(model: Any) -> None:
    """Put the class' own steps back and drop the compiled functions."""
    for name in model.__dict__.pop(_INSTALLED_STEPS, ()):
        model.__dict__.pop(name, None)
    reset_compiled_functions(model)


def reset_compiled_functions(model: Any) -> None:
    """Drop compiled steps: Keras compiles them again at the next call."""
    for name in COMPILED_FUNCTIONS:
        setattr(model, name, None)


_COMPILED_CACHE = "_keras_dist_compiled"


def _compile_key(model: Any, distribution: Any) -> tuple[Any, ...]:
    """What a compiled step depends on besides its inputs' shapes: another
    distribution or a `compile()` since the last run means compiling again."""
    return (
        distribution,
        getattr(model, "optimizer", None),  # None: never compiled
        getattr(model, "_compile_loss", None),
        getattr(model, "_compile_metrics", None),
        model.steps_per_execution,
        model.jit_compile,
        model.run_eagerly,
    )


def _same_key(first: tuple[Any, ...], second: tuple[Any, ...]) -> bool:
    return len(first) == len(second) and all(
        a is b or (type(a) in (int, bool) and a == b)
        for a, b in zip(first, second, strict=True)
    )


def install_cached_steps(
    model: Any, distribution: Any, make_steps: Callable[[], dict[str, Callable]]
) -> None:
    """`install_steps` with the steps and compiled functions of the previous
    run when nothing they depend on changed (`remove_cached_steps` keeps them),
    so calling `fit` in a loop does not compile or trace every time."""
    key = _compile_key(model, distribution)
    cached = model.__dict__.get(_COMPILED_CACHE)
    if cached is not None and _same_key(cached["key"], key):
        install_steps(model, cached["steps"])
        for name in COMPILED_FUNCTIONS:
            setattr(model, name, cached["compiled"].get(name))
        return
    steps = make_steps()
    install_steps(model, steps)
    model.__dict__[_COMPILED_CACHE] = {"key": key, "steps": steps, "compiled": {}}


def remove_cached_steps(model: Any) -> None:
    """`remove_steps`, keeping the compiled functions for the next run."""
    cached = model.__dict__.get(_COMPILED_CACHE)
    if cached is not None:
        cached["compiled"] = {name: getattr(model, name) for name in COMPILED_FUNCTIONS}
    remove_steps(model)


def uses_keras_compute_metrics(model: Any) -> bool:
    """Whether `model` keeps Keras' own `compute_metrics` (not overridden)."""
    own = type(model).compute_metrics
    return getattr(own, "__qualname__", "").endswith("Trainer.compute_metrics")


def layers_of(model: Any) -> list[Any]:
    """`model` and every layer in it, nested ones included."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def sublayers(layer: Any) -> list[Any]:
    """The layers `layer` holds directly (for `keras_dist.flops`)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def graph_calls(model: Any) -> dict[int, int] | None:
    """How many times `model`'s graph calls each layer, by `id`, for a
    functional model or a Sequential built as one; None for other layers."""
    from keras.src.models.functional import Functional  # noqa: PLC0415

    graph = getattr(model, "_functional", None) or model
    if not isinstance(graph, Functional):
        return None
    calls: dict[int, int] = {}
    for nodes in graph._nodes_by_depth.values():
        for node in nodes:
            calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    return calls


def grouped_attention_projections(layer: Any) -> dict[str, Any]:
    """The `EinsumDense` projections of a `GroupQueryAttention` layer."""
    return {
        "query": layer._query_dense,
        "key": layer._key_dense,
        "value": layer._value_dense,
        "output": layer._output_dense,
    }


class GlobalBatchNorm:
    """BatchNormalization's training statistics over the real rows of the batch.

    One device normalizes a batch with the mean and variance of all its rows.
    Split over replicas, each would use its own share's (like torch DDP without
    `SyncBatchNorm`, or `tf.distribute` without `synchronized=True`), and a
    padded last batch would count its padding rows. While `install`ed, a
    layer's `_moments` leaves the padding rows out and, with a `Replicas` that
    sums over replicas, combines every replica's count, mean and sum of squared
    deviations (the parallel form of the two-pass variance, as torch's
    `SyncBatchNorm` does; stable for inputs far from zero) -- one all-reduce
    whose gradient is the all-reduce of the gradients -- so N replicas match
    one device. With `Replicas()` (one replica: JAX's global arrays, or
    per-replica statistics by choice) it only leaves the padding out.

    Only inside `rows(mask)`, which the keras_dist train steps enter with their
    batch's row mask; anything else running the layer in training mode gets
    Keras' own moments (and no collective that other replicas would not join).
    The mask is per thread: `MirroredStrategy` runs each replica in a thread.
    """

    @dataclass(frozen=True)
    class Replicas:
        """How a replica reaches the others: `sum` adds a tensor over all of
        them (differentiably); `index()` and `count` say which one it is."""

        sum: Callable[[Any], Any] = lambda tensor: tensor
        index: Callable[[], Any] = lambda: 0
        count: int = 1

    _current = threading.local()

    @classmethod
    @contextlib.contextmanager
    def rows(cls, mask: Any, padded: bool = True) -> Iterator[None]:
        """Inside: the step's batch has row mask `mask`; `padded=False` (when
        the caller knows no row is padding) lets one replica use Keras' own,
        cheaper moments."""
        previous = getattr(cls._current, "mask", None), cls._padded()
        cls._current.mask, cls._current.padded = mask, padded
        try:
            yield
        finally:
            cls._current.mask, cls._current.padded = previous

    @classmethod
    def _padded(cls) -> bool:
        return getattr(cls._current, "padded", True)

    @classmethod
    def install(cls, model: Any, replicas: GlobalBatchNorm.Replicas) -> list:
        """Returns the layers changed, for `uninstall`."""
        layers = [
            layer
            for layer in layers_of(model)
            if isinstance(layer, keras.layers.BatchNormalization)
        ]
        for layer in layers:
            # On the instance, past Keras' attribute tracking; the class' method
            # comes back when it is removed.
            layer.__dict__["_moments"] = functools.partial(
                cls._moments, layer, replicas
            )
        return layers

    @staticmethod
    def uninstall(layers: list) -> None:
        for layer in layers:
            layer.__dict__.pop("_moments", None)

    @staticmethod
    def _row_weights(layer: Any, rows: Any, inputs: Any) -> Any:
        """The row mask, shaped to broadcast against `inputs`."""
        ops = keras.ops
        batch, share = inputs.shape[0], rows.shape[0]
        if batch is not None and share is not None and batch != share:
            # The layer sees another first axis than the batch's rows (say, two
            # views stacked): fine without padding, wrong with it.
            try:
                padded = not bool(ops.all(rows > 0))
            except Exception:  # traced (JAX, tf.function): cannot look now
                padded = False
                warnings.warn(
                    f"BatchNormalization layer {layer.name!r} gets inputs of shape "
                    f"{tuple(inputs.shape)}, whose first axis is not the batch's "
                    f"{share} rows: if a batch is padded (it does not divide the "
                    "devices), its padding rows count in this layer's statistics.",
                    UserWarning,
                    stacklevel=2,
                )
            if padded:
                raise NotImplementedError(
                    f"BatchNormalization layer {layer.name!r} gets inputs of shape "
                    f"{tuple(inputs.shape)}, whose first axis is not the batch's "
                    f"{share} rows, so keras_dist cannot leave the padding rows of "
                    "an uneven batch out of its statistics. Use a global batch "
                    "that divides the dataset and the devices, or "
                    "`DataParallel(sync_batch_norm=False)`."
                )
            rows = ops.ones((batch,), inputs.dtype)
        rows = ops.cast(rows, inputs.dtype)
        return ops.reshape(rows, (-1,) + (1,) * (len(inputs.shape) - 1))

    @classmethod
    def _moments(
        cls, layer: Any, replicas: GlobalBatchNorm.Replicas, inputs: Any, mask: Any
    ) -> tuple[Any, Any]:
        rows = getattr(cls._current, "mask", None)
        if rows is None or (replicas.count == 1 and not cls._padded()):
            return type(layer)._moments(layer, inputs, mask)
        ops = keras.ops
        axes = tuple(layer._reduction_axes)
        weight = cls._row_weights(layer, rows, inputs)
        if mask is None and 0 in axes:
            # Per-row sums first: as many passes over the inputs as Keras' own.
            others = tuple(axis for axis in axes if axis != 0)

            def over_rows(values: Any) -> Any:
                per_row = ops.sum(values, others, keepdims=True) if others else values
                return ops.sum(per_row * weight, 0, keepdims=True)

            total = over_rows(inputs)
            # Rows times positions per row, without a pass over the inputs.
            positions = ops.cast(ops.size(inputs[:1]), inputs.dtype) / ops.cast(
                ops.size(total), inputs.dtype
            )
            count = ops.ones_like(total) * ops.sum(weight) * positions
        else:
            if mask is not None:
                weight = weight * ops.expand_dims(ops.cast(mask, inputs.dtype), -1)
            weight = ops.broadcast_to(weight, ops.shape(inputs))

            def over_rows(values: Any) -> Any:
                return ops.sum(values * weight, axes, keepdims=True)

            count = over_rows(ops.ones_like(inputs))
            total = over_rows(inputs)
        # This replica's count, mean and sum of squared deviations.
        mean = total / ops.maximum(count, 1.0)
        deviations = over_rows(ops.square(inputs - mean))
        local = ops.stack([count, mean, deviations])
        if replicas.count > 1:
            # Every replica's statistics in one all-reduce: each fills its slot.
            slot = ops.one_hot(replicas.index(), replicas.count, dtype=local.dtype)
            slot = ops.reshape(slot, (replicas.count,) + (1,) * len(local.shape))
            each = replicas.sum(slot * local[None])
        else:
            each = local[None]
        counts, means, deviations = each[:, 0], each[:, 1], each[:, 2]
        total = ops.sum(counts, 0)
        mean = ops.sum(counts * means, 0) / ops.maximum(total, 1.0)
        spread = ops.sum(deviations, 0) + ops.sum(counts * ops.square(means - mean), 0)
        variance = spread / ops.maximum(total, 1.0)
        return ops.squeeze(mean, axes), ops.squeeze(variance, axes)


# -- `Distribution.distribute_dataset`: Keras' data adapter or a direct call ------
_in_keras_data_adapter = threading.local()


def keras_builds_data_adapter() -> bool:
    """Whether Keras' tf.data adapter (built by `fit`/`evaluate`/`predict`) is
    running, the one caller of `Distribution.distribute_dataset` in Keras."""
    return getattr(_in_keras_data_adapter, "depth", 0) > 0


def mark_keras_data_adapter() -> None:
    """Make `keras_builds_data_adapter()` true while Keras' `TFDatasetAdapter`
    is built (idempotent)."""
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        tf_dataset_adapter,
    )

    adapter_class = tf_dataset_adapter.TFDatasetAdapter
    original = adapter_class.__init__
    if getattr(original, "_keras_dist_marked", False):
        return

    @functools.wraps(original)
    def marked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_in_keras_data_adapter, "depth", 0)
        _in_keras_data_adapter.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _in_keras_data_adapter.depth = depth

    marked_init._keras_dist_marked = True  # type: ignore[attr-defined]
    adapter_class.__init__ = marked_init


def is_tf_dataset(value: Any) -> bool:
    """Whether `value` is a `tf.data.Dataset`, asked as Keras asks (without
    importing TensorFlow)."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415

    return data_adapters.is_tf_dataset(value)


def _check_dataset_sharding() -> list[str]:
    """What `Distribution.distribute_dataset` relies on."""
    from keras.src.trainers import data_adapters  # noqa: PLC0415
    from keras.src.trainers.data_adapters import (  # noqa: PLC0415
        tf_dataset_adapter,
    )

    missing = []
    if not callable(getattr(data_adapters, "is_tf_dataset", None)):
        missing.append("keras.src.trainers.data_adapters.is_tf_dataset")
    init = tf_dataset_adapter.TFDatasetAdapter.__init__
    if "distribution" not in inspect.signature(init).parameters:
        missing.append("TFDatasetAdapter(dataset, distribution=...)")
    source = inspect.getsource(inspect.unwrap(init))
    if "distribute_dataset" not in source:
        missing.append("TFDatasetAdapter calls distribution.distribute_dataset")
    for name in ("distribute_tf_dataset", "data_shard_id", "num_processes"):
        if not hasattr(KerasDistribution, name):
            missing.append(f"Distribution.{name}")
    return missing


def slot_owners(optimizer: Any, model_variables: list[Any]) -> dict[int, Any]:
    """Map each optimizer slot (by `id`) to the model variable it mirrors.

    Keras names a slot `"<variable path with _ for />_<slot name>"` and gives
    it the variable's shape (`Optimizer.add_variable_from_reference`); the
    longest matching prefix of the same shape is the owner.
    """
    prefixes = [
        (variable.path.replace("/", "_") + "_", variable)
        for variable in model_variables
    ]
    prefixes.sort(key=lambda item: len(item[0]), reverse=True)
    owners: dict[int, Any] = {}
    for slot in optimizer.variables:
        for prefix, variable in prefixes:
            if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(
                variable.shape
            ):
                owners[id(slot)] = variable
                break
    return owners


def check() -> list[str]:
    """Names of the Keras details this release no longer matches."""
    missing = []
    for name in MODEL_CALLS:
        call = getattr(keras.Model, name, None)
        target = getattr(call, "__wrapped__", call)
        if (
            not callable(target)
            or "callbacks" not in inspect.signature(target).parameters
        ):
            missing.append(f"keras.Model.{name}(..., callbacks=...)")
    dense = keras.layers.Dense(2, name="probe")
    dense.build((None, 3))
    sgd = keras.optimizers.SGD(momentum=0.9)
    sgd.build(dense.trainable_variables)
    if len(slot_owners(sgd, dense.trainable_variables)) != 2:
        missing.append("Optimizer.add_variable_from_reference slot naming")
    model = keras.Sequential([keras.layers.BatchNormalization()])
    if not hasattr(model, "_flatten_layers"):
        missing.append("Layer._flatten_layers")
    batch_norm = model.layers[0]
    if not callable(getattr(batch_norm, "_moments", None)):
        missing.append("BatchNormalization._moments")
    batch_norm.build((None, 3))
    if list(getattr(batch_norm, "_reduction_axes", None) or []) != [0]:
        missing.append("BatchNormalization._reduction_axes")
    if KerasDistribution.__name__ != "Distribution" or not issubclass(
        keras.distribution.ModelParallel, KerasDistribution
    ):
        missing.append("keras.distribution.DataParallel.__mro__[1] is Distribution")
    for name in (
        "scope",
        "get_data_layout",
        "get_variable_layout",
        "get_tensor_layout",
    ):
        if not hasattr(KerasDistribution, name):
            missing.append(f"Distribution.{name}")
    if not _shapes_only_variables_are_forgotten():
        missing.append("global_state 'uninitialized_variables' (keras_dist.plan)")
    missing += _check_dataset_sharding()
    if not _shuffle_follows_numpy_stream():
        missing.append("ArrayDataAdapter shuffles with NumPy's global generator")
    missing += _check_saving()
    missing += _check_row_aware_metrics()
    missing += _check_resume()
    missing += _check_flop_walk()
    return missing


def _check_flop_walk() -> list[str]:
    """What `sublayers`, `graph_calls` and `grouped_attention_projections`
    (keras_dist.flops) need."""
    missing = []
    inputs = keras.Input((3,))
    shared = keras.layers.Dense(3)
    model = keras.Model(inputs, shared(shared(inputs)))
    if (graph_calls(model) or {}).get(id(shared)) != 2:
        missing.append("Functional._nodes_by_depth nodes with .operation")
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    if graph_calls(sequential) is None:
        missing.append("Sequential._functional")
    if not set(map(id, sequential.layers)) <= set(map(id, sublayers(sequential))):
        missing.append("Layer._flatten_layers(include_self=False, recursive=False)")
    attention = keras.layers.GroupQueryAttention(2, 2, 1)
    attention.build((None, 4, 4), (None, 4, 4))
    try:
        projections = list(grouped_attention_projections(attention).values())
    except AttributeError:
        projections = []
    if [type(layer) for layer in projections] != [keras.layers.EinsumDense] * 4:
        missing.append("GroupQueryAttention._query_dense/_key_dense/...")
    return missing


def _check_row_aware_metrics() -> list[str]:
    """Keras' loss trackers get the batch's row count through `Mean.update_state`
    (per output too), compiled metrics update through `CompileMetrics`, and
    optimizers apply gradients through `apply` (see `install_row_aware_metrics`,
    `average_gradients_in`)."""
    from keras_dist.custom_steps import StepRows, step_rows  # noqa: PLC0415

    missing = []
    for cls, name in (
        (keras.metrics.Mean, "update_state"),
        (keras.metrics.MeanMetricWrapper, "update_state"),
        (_KerasCompileMetrics, "update_state"),
        (compile_utils.CompileLoss, "metrics"),
        (keras.optimizers.Optimizer, "apply"),
    ):
        if not hasattr(cls, name):
            missing.append(f"{cls.__name__}.{name}")
    if missing:
        return missing
    install_row_aware_metrics()
    inputs = keras.Input((2,))
    model = keras.Model(
        inputs,
        {"a": keras.layers.Dense(1)(inputs), "b": keras.layers.Dense(1)(inputs)},
    )
    model.compile(loss={"a": "mse", "b": "mse"}, metrics={"a": ["mae"]})
    x, y = np.ones((4, 2), "float32"), {"a": np.zeros((4, 1)), "b": np.zeros((4, 1))}
    y_pred = model(x)
    mask = np.array([1.0, 1.0, 1.0, 0.0], "float32")
    rows = StepRows(model, mask, mask, mask, tracked_rows=3.0)
    with step_rows(rows):
        model.compute_loss(x, y, y_pred)
        model.compute_metrics(x, y, y_pred)
    counts = [float(m.count) for m in model._compile_loss.metrics if m]
    if not counts or counts != [3.0] * len(counts):
        missing.append("CompileLoss weighs per-output losses by the row count")
    compiled = [m for m in model._compile_metrics.metrics if hasattr(m, "count")]
    if not compiled or any(float(m.count) != 3.0 for m in compiled):
        missing.append("CompileMetrics.update_state updates the compiled metrics")
    return missing


def _check_saving() -> list[str]:
    """What `wrap_saving_functions` and `one_writer_backup_and_restore` need."""
    import inspect  # noqa: PLC0415

    from keras.src.saving import saving_api  # noqa: PLC0415

    missing = []
    for name in SAVING_FUNCTIONS:
        function = getattr(saving_api, name, None)
        function = getattr(function, "__wrapped__", function)
        parameters = list(inspect.signature(function).parameters)
        if parameters[:2] != ["model", "filepath"]:
            missing.append(f"keras.src.saving.saving_api.{name}(model, filepath)")
    for method, name in (
        (keras.Model.save, "save_model"),
        (keras.Model.save_weights, "save_weights"),
    ):
        if f"saving_api.{name}(" not in inspect.getsource(method):
            missing.append(f"Model.{method.__name__} calls saving_api.{name}")
    backup = keras.callbacks.BackupAndRestore("probe")
    for name in (
        "_load_model",
        "_save_model",
        "_weights_path",
        "_prev_weights_path",
        "_training_metadata_path",
        "_prev_training_metadata_path",
    ):
        if not hasattr(backup, name):
            missing.append(f"BackupAndRestore.{name}")
    from keras.src.callbacks import model_checkpoint  # noqa: PLC0415
    from keras.src.utils import file_utils  # noqa: PLC0415

    if getattr(model_checkpoint, "file_utils", None) is not file_utils or not callable(
        getattr(file_utils, "makedirs", None)
    ):
        missing.append("ModelCheckpoint creates directories with file_utils.makedirs")
    return missing


def _shuffle_follows_numpy_stream() -> bool:
    from keras.src.trainers.data_adapters.array_data_adapter import (  # noqa: PLC0415
        ArrayDataAdapter,
    )

    def order(seed: int) -> list[int]:
        adapter = ArrayDataAdapter(np.arange(64)[:, None], batch_size=64, shuffle=True)
        with numpy_random_stream(np.random.RandomState(seed)):
            batch = next(iter(adapter.get_numpy_iterator()))
        return [int(value) for value in np.asarray(batch[0]).reshape(-1)]

    return order(0) == order(0) != order(1)


# -- checkpoint keys: Keras' own `.weights.h5` structural paths ---------------


def saveable_variables(model: Any) -> dict[str, Any]:
    """Every variable of `model`'s training state by Keras' `.weights.h5`
    structural path (`layers/dense/vars/0`, `optimizer/vars/3`), the same in
    every process and on every backend, unlike `variable.path`, whose
    auto-numbered names depend on what the process built before.

    Follows `saving_lib._save_state`'s walk (same order, same names), reading
    each layer's own variables without copying them (Keras' optimizer saving
    would gather sharded ones), plus what `.weights.h5` leaves out: each
    layer's seed generators (`<layer>/seed_generators/<j>`, so Dropout goes on
    the same) and the metric states (`metrics/vars/<i>`).
    """
    from keras.src.saving import saving_lib  # noqa: PLC0415
    from keras.src.saving.keras_saveable import KerasSaveable  # noqa: PLC0415
    from keras.src.utils import naming  # noqa: PLC0415

    found: dict[str, Any] = {}
    visited: set[int] = set()

    def own(saveable: Any, path: str) -> None:
        if isinstance(saveable, keras.optimizers.Optimizer):
            variables = list(saveable.variables)
        elif isinstance(saveable, keras.layers.Layer):
            if (
                type(saveable).save_own_variables
                is not keras.layers.Layer.save_own_variables
            ):
                recorded: dict[str, Any] = {}
                saveable.save_own_variables(recorded)
                variables = list(recorded.values())
                if not all(isinstance(v, keras.Variable) for v in variables):
                    raise NotImplementedError(
                        f"Layer {saveable.name!r} ({type(saveable).__name__}) saves "
                        "values that are not Keras variables in its own "
                        "save_own_variables; keras_dist checkpoints save variables "
                        "shard by shard and cannot save it. Save it with "
                        "model.save_weights instead."
                    )
            else:
                variables = saveable._trainable_variables + (
                    saveable._non_trainable_variables
                )
            for j, generator in enumerate(getattr(saveable, "_seed_generators", [])):
                found[_join(path, f"seed_generators/{j}")] = generator.state
        else:
            return
        for i, variable in enumerate(variables):
            found[_join(path, f"vars/{i}")] = variable

    def walk(saveable: Any, path: str) -> None:
        if id(saveable) in visited:
            return
        own(saveable, path)
        visited.add(id(saveable))
        for attribute, child in saving_lib._walk_saveable(saveable):
            if isinstance(child, KerasSaveable):
                walk(child, _join(path, attribute))
            elif isinstance(child, list | dict | tuple):
                container(child, _join(path, attribute), set())

    def container(items: Any, path: str, seen: set[int]) -> None:
        if id(items) in seen:
            return
        seen.add(id(items))
        used: dict[str, int] = {}
        for item in list(items.values()) if isinstance(items, dict) else items:
            if isinstance(item, KerasSaveable):
                name = saving_lib._get_unique_name(
                    naming.to_snake_case(item.__class__.__name__), used
                )
                walk(item, _join(path, name))
            elif isinstance(item, list | dict | tuple):
                container(
                    item,
                    _join(path, saving_lib._get_unique_name("container", used)),
                    seen,
                )

    walk(model, "")
    for i, variable in enumerate(model.metrics_variables):
        found[f"metrics/vars/{i}"] = variable
    return found


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


# -- resuming fit where a checkpoint left it ----------------------------------

_EpochIterator = None  # keras.src.trainers.epoch_iterator.EpochIterator
_resume_at: list[int] = []  # the step the next epoch starts at (one-shot)
# Called right before and right after an epoch's data iterator is made (see
# `watch_new_iterators`).
_iterator_watcher: list[tuple[Callable[[], None], Callable[[], None]]] = []


def watch_new_iterators(before: Callable[[], None], after: Callable[[], None]) -> None:
    """Call `before()` right before `fit` makes an epoch's data iterator and
    `after()` right after (the moment a DataLoader or a `tf.data` pipeline
    draws from the random generators), replacing the previous watcher."""
    _install_epoch_start()
    _iterator_watcher[:] = [(before, after)]


def start_next_epoch_at(step: int) -> None:
    """The next epoch that `fit` enumerates starts at batch `step`: the first
    `step` batches are read and dropped (so the data, shuffled or not, goes
    on where it was), callbacks see `on_train_batch_begin(step)` first, and
    the progress bar counts from there. Consumed by that epoch; call it from
    `on_epoch_begin`, before the epoch reads its first batch."""
    _install_epoch_start()
    _resume_at[:] = [int(step)]


def _install_epoch_start() -> None:
    global _EpochIterator
    if _EpochIterator is not None:
        return
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    original = EpochIterator._enumerate_iterator

    @functools.wraps(original)
    def enumerate_iterator(self: Any) -> Iterator[Any]:
        start = _resume_at.pop() if _resume_at else 0
        return (yield from _enumerate_from(self, start))

    enumerate_iterator._keras_original = original
    EpochIterator._enumerate_iterator = enumerate_iterator
    _EpochIterator = EpochIterator


def _new_iterator(self: Any) -> Iterator[Any]:
    for before, _ in list(_iterator_watcher):
        before()
    iterator = iter(self._get_iterator())
    for _, after in list(_iterator_watcher):
        after()
    if _batch_read_timers:
        return _timed_reads(iterator)
    return iterator


# What to call with the seconds each `next()` on an epoch's data iterator took
# (see `time_batch_reads`): weak references, so a callback that a raising
# `fit` never told to stop is dropped with its last user reference.
_batch_read_timers: list[Callable[[], Callable[[float], None] | None]] = []


def time_batch_reads(record: Callable[[float], None]) -> Callable[[], None]:
    """Call `record(seconds)` after each batch read from the epoch iterators
    `fit`, `evaluate` and `predict` make from now on (a `next()` on the data
    iterator), until the returned function is called or `record`'s object
    (a bound method's) is gone. Only for backends whose steps read their
    batches in Python: a TensorFlow step reads its batches inside its
    compiled function, from the iterator object itself."""
    _install_epoch_start()
    reference: Callable[[], Callable[[float], None] | None]
    if inspect.ismethod(record):
        reference = weakref.WeakMethod(record)
    else:
        reference = lambda: record  # noqa: E731
    _batch_read_timers.append(reference)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            _batch_read_timers.remove(reference)

    return stop


def _timed_reads(iterator: Iterator[Any]) -> Iterator[Any]:
    clock = time.perf_counter
    while True:
        start = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        seconds = clock() - start
        for reference in list(_batch_read_timers):
            record = reference()
            if record is None:
                with contextlib.suppress(ValueError):
                    _batch_read_timers.remove(reference)
            else:
                record(seconds)
        yield batch


def _enumerate_from(self: Any, start: int) -> Iterator[Any]:
    """Keras' `EpochIterator._enumerate_iterator`, from batch `start`, telling
    the watcher when it makes an iterator."""
    self.data_adapter.on_epoch_begin()
    steps_per_epoch = self.steps_per_epoch or self._num_batches or -1
    if steps_per_epoch > 0:
        if self._current_iterator is None or self.steps_per_epoch is None:
            self._current_iterator = _new_iterator(self)
            self._steps_seen = 0
        for _ in range(start):
            next(self._current_iterator)
        self._steps_seen += start
        for step in range(start, steps_per_epoch, self.steps_per_execution):
            if self._num_batches and self._steps_seen >= self._num_batches:
                if self.steps_per_epoch:
                    self._interrupted_warning()
                break
            self._steps_seen += self.steps_per_execution
            yield step, step + self.steps_per_execution - 1, self._current_iterator
        if self._num_batches and self._steps_seen >= self._num_batches:
            self._current_iterator = _new_iterator(self)
            self._steps_seen = 0
    else:
        iterator = _new_iterator(self)
        for _ in range(start):
            next(iterator)
        step = start - self.steps_per_execution
        while True:
            step += self.steps_per_execution
            self._steps_seen = step + self.steps_per_execution
            yield step, step + self.steps_per_execution - 1, iterator
    self.data_adapter.on_epoch_end()


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch the `fit` now starting begins at (read right after
    `on_train_begin`), as Keras' `BackupAndRestore` sets it; None: the
    `initial_epoch` argument."""
    model._initial_epoch = epoch


def calling_callback_list() -> Any:
    """The `CallbackList` whose `set_model` is calling the caller's
    `set_model` (Keras gives a callback no handle on its siblings), or None."""
    import sys  # noqa: PLC0415

    frame = sys._getframe(2)
    for _ in range(6):  # a subclass' set_model may call super()'s
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.callbacks.CallbackList):
            return candidate
        frame = frame.f_back
    return None


def _check_resume() -> list[str]:
    """What `start_next_epoch_at`, `set_initial_epoch`, `calling_callback_list`
    and `saveable_variables` need."""
    from keras.src.saving import saving_lib  # noqa: PLC0415
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    missing = []
    method = EpochIterator._enumerate_iterator
    source = inspect.getsource(getattr(method, "_keras_original", method))
    for needle in (
        "self._current_iterator",
        "self._steps_seen",
        "steps_per_execution",
        "iter(self._get_iterator())",
        "self._interrupted_warning()",
    ):
        if needle not in source:
            missing.append(f"EpochIterator._enumerate_iterator uses {needle}")
    trainer_source = inspect.getsource(type(keras.Model()).fit)
    if "self._initial_epoch or initial_epoch" not in trainer_source:
        missing.append("fit reads model._initial_epoch after on_train_begin")
    if "callback.set_model(model)" not in inspect.getsource(
        keras.callbacks.CallbackList.set_model
    ):
        missing.append("CallbackList.set_model calls each callback's set_model")
    for name in ("_walk_saveable", "_get_unique_name"):
        if not callable(getattr(saving_lib, name, None)):
            missing.append(f"keras.src.saving.saving_lib.{name}")
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    if not hasattr(dense, "_trainable_variables") or not hasattr(
        dense, "_seed_generators"
    ):
        missing.append("Layer._trainable_variables / Layer._seed_generators")
    return missing


@contextlib.contextmanager
def shapes_only_variables() -> Iterator[None]:
    """Variables created inside the block have a path, shape and dtype but no
    value: Keras defers their initialisation (`keras.StatelessScope`), and on
    exit they are dropped from Keras' list of variables to initialise later,
    so no later scope allocates them. Used by `keras_dist.plan`."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    name = "uninitialized_variables"
    before = {id(v) for v in global_state.get_global_attribute(name) or []}
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        pending = global_state.get_global_attribute(name)
        if pending:
            pending[:] = [v for v in pending if id(v) in before]


def _shapes_only_variables_are_forgotten() -> bool:
    from keras.src.backend.common import global_state  # noqa: PLC0415

    with shapes_only_variables():
        probe = keras.Variable(initializer="zeros", shape=(2,), name="probe")
        pending = global_state.get_global_attribute("uninitialized_variables") or []
        registered = any(variable is probe for variable in pending)
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    return registered and all(variable is not probe for variable in pending)
