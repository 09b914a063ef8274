"""BatchNormalization's statistics over the real rows of the global batch."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import keras


class GlobalBatchNorm:
    """BatchNormalization's training statistics over the real rows of the batch.

    One device normalizes a batch with the mean and variance of all its rows.
    Split over replicas, each would use its own share's (like torch DDP without
    `SyncBatchNorm`, or `tf.distribute` without `synchronized=True`), and a
    padded last batch would count its padding rows. In place of a layer's
    `_moments`, `moments` leaves the padding rows out and, with a `Replicas` that
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
        # A backend's own global moments, the same statistics in fewer ops:
        # `(inputs, axes) -> (mean, variance)`, called when every row is real
        # and `axes` is every axis but the channels' (torch: `global_moments`).
        fused: Callable[[Any, tuple[int, ...]], tuple[Any, Any]] | None = None
        # A backend's own global batch normalization, moments and
        # normalization in one op each way: `(inputs, scale, offset,
        # epsilon) -> (outputs, mean, variance)`, called when every row is
        # real and the channels are the last axis (torch: `global_batch_norm`).
        normalize: Callable[[Any, Any, Any, float], tuple[Any, Any, Any]] | None = None

    _current = threading.local()

    @classmethod
    @contextlib.contextmanager
    def rows(cls, mask: Any, padded: bool = True) -> Iterator[None]:
        """Inside: the step's batch has row mask `mask`; `padded=False` (when
        the caller knows no row is padding) lets one replica use Keras' own,
        cheaper moments."""
        previous = cls.enter_rows(mask, padded)
        try:
            yield
        finally:
            cls.leave_rows(previous)

    @classmethod
    def enter_rows(cls, mask: Any, padded: bool = True) -> tuple[Any, bool]:
        """`rows(mask, padded)` without a context manager, for a step that
        `torch.compile` traces through a call it cannot trace (DDP's forward):
        TorchDynamo resumes after such a call, but not inside a generator's
        context. Returns what `leave_rows` puts back; `clear` undoes it after
        an error."""
        previous = getattr(cls._current, "mask", None), cls._padded()
        cls._current.mask, cls._current.padded = mask, padded
        return previous

    @classmethod
    def leave_rows(cls, previous: tuple[Any, bool]) -> None:
        cls._current.mask, cls._current.padded = previous

    @classmethod
    def clear(cls) -> None:
        """No step's rows in this thread (after a step that raised between
        `enter_rows` and `leave_rows`)."""
        cls._current.mask, cls._current.padded = None, True

    @classmethod
    def _padded(cls) -> bool:
        return getattr(cls._current, "padded", True)

    @staticmethod
    def _row_weights(name: str, rows: Any, inputs: Any) -> Any:
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
                    f"BatchNormalization layer {name!r} gets inputs of shape "
                    f"{tuple(inputs.shape)}, whose first axis is not the batch's "
                    f"{share} rows: if a batch is padded (it does not divide the "
                    "devices), its padding rows count in this layer's statistics.",
                    UserWarning,
                    stacklevel=2,
                )
            if padded:
                raise NotImplementedError(
                    f"BatchNormalization layer {name!r} gets inputs of shape "
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
    def normalize(
        cls,
        replicas: GlobalBatchNorm.Replicas,
        inputs: Any,
        *,
        axes: tuple[int, ...],
        scale: Any,
        offset: Any,
        epsilon: float,
    ) -> tuple[Any, Any, Any] | None:
        """A training-mode BatchNormalization of `inputs` (reduced over `axes`,
        with `scale` and `offset` or None, as the layer's gamma and beta) by
        the backend's own op: `(outputs, mean, variance)`, the same as Keras'
        normalization with `moments`' statistics; None where that op does not
        apply (outside `rows(...)`, one replica, a padded batch, channels not
        last), and the layer then runs its own `call` with `moments`."""
        if (
            replicas.normalize is None
            or replicas.count == 1
            or getattr(cls._current, "mask", None) is None
            or cls._padded()
            or len(inputs.shape) < 2
            or tuple(axes) != tuple(range(len(inputs.shape) - 1))
        ):
            return None
        return replicas.normalize(inputs, scale, offset, epsilon)

    @classmethod
    def moments(
        cls,
        replicas: GlobalBatchNorm.Replicas,
        inputs: Any,
        mask: Any,
        *,
        axes: tuple[int, ...],
        keras_moments: Callable[[Any, Any], tuple[Any, Any]],
        name: str,
    ) -> tuple[Any, Any]:
        """The mean and variance a BatchNormalization layer `name` normalizes
        `inputs` with (reduced over `axes`, its `_reduction_axes`), inside
        `rows(...)`; Keras' own (`keras_moments(inputs, mask)`) outside. Keras
        calls it in place of the layer's own `_moments` while
        `keras_dist.keras_compat.batch_norm.replace_moments` is in effect."""
        rows = getattr(cls._current, "mask", None)
        if rows is None or (replicas.count == 1 and not cls._padded()):
            return keras_moments(inputs, mask)
        ops = keras.ops
        if (
            replicas.fused is not None
            and mask is None
            and not cls._padded()
            and 0 in axes
            and len(axes) == len(inputs.shape) - 1
        ):
            return replicas.fused(inputs, axes)
        weight = cls._row_weights(name, rows, inputs)
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
