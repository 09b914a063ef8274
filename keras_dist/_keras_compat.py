"""The backend-neutral Keras details keras_dist relies on, in one place.

`tests/test_keras_internals.py` checks each of them, so a Keras release that
moves one fails that test loudly instead of breaking users quietly.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

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
# is collective, so every process must save; see `save_to_scratch`.)
FILE_WRITING_CALLBACKS = (
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
)


def save_to_scratch(model: Any) -> Callable[[], None]:
    """Make `model.save` and `model.save_weights` write to a scratch directory
    that is deleted at once; return the function that undoes it.

    Used on processes other than 0: they still read every variable (which is
    collective when arrays span processes) so that process 0's checkpoint does
    not wait for them, but only process 0's file is kept.
    """
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    cls = type(model)

    def redirect(method_name: str) -> Callable[..., Any]:
        method = getattr(cls, method_name)

        def to_scratch(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            with tempfile.TemporaryDirectory(prefix="keras_dist_scratch_") as scratch:
                target = os.path.join(scratch, os.path.basename(str(filepath)))
                return method(model, target, *args, **kwargs)

        return to_scratch

    for name in ("save", "save_weights"):
        object.__setattr__(model, name, redirect(name))

    def restore() -> None:
        for name in ("save", "save_weights"):
            model.__dict__.pop(name, None)

    return restore


def _do_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def silence_callbacks(classes: tuple[type, ...]) -> Callable[[], None]:
    """Make every callback of `classes` do nothing in this process; return the
    function that restores them.

    Called on processes other than 0 for the duration of a distributed call, so
    progress, logs and checkpoints of replicated state appear once. Patching the
    classes rather than a setting also covers the hooks Keras runs on its
    callback threads, where thread-local settings do not reach.
    """
    saved: list[tuple[type, str, Any]] = []
    for cls in classes:
        for name in dir(cls):
            if name.startswith("on_") and callable(getattr(cls, name)):
                saved.append((cls, name, cls.__dict__.get(name)))
                setattr(cls, name, _do_nothing)

    def restore() -> None:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)

    return restore


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
        model.optimizer,
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
    if not _shuffle_follows_numpy_stream():
        missing.append("ArrayDataAdapter shuffles with NumPy's global generator")
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
