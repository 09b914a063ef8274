"""Learning rates for a larger global batch: the scaling rules and a warmup.

Data parallelism multiplies the batch a learning rate was tuned for. Two rules
adapt it: "linear" (Goyal et al., 2017, "Accurate, Large Minibatch SGD": the
learning rate grows with the batch, reached by a gradual warmup) and "sqrt"
(with the square root of the ratio: Krizhevsky, 2014, "One weird trick";
often preferred for adaptive optimizers such as Adam). In keras_dist the
`batch_size` given to `fit` is the global batch; it is not known before `fit`
is called, so it is an argument here. Left out, it is taken from a
distribution: `base_batch_size` rows on each of its data-parallel replicas,
the habit of DDP users who keep the per-device batch and scale by the number
of devices (then `fit` needs `batch_size=base_batch_size * replicas`).
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from keras_dist.common.validation import check_positive_int
from keras_dist.distribution.state import distribution as active_distribution
from keras_dist.keras_compat.distribution import KerasDistribution

RULES = ("linear", "sqrt")


def _check_rule(rule: Any) -> None:
    if rule not in RULES:
        raise ValueError(
            f"`rule` must be one of {list(RULES)}. Received: rule={rule!r}"
        )


def _data_parallel_replicas(distribution: Any) -> int:
    """How many replicas of `distribution` see different rows of each batch
    (the size of its mesh's batch axis); works for Keras' own policies too."""
    mesh = distribution.device_mesh
    axis = list(mesh.axis_names).index(distribution.batch_dim_name)
    return int(mesh.shape[axis])


def _global_batch_size(
    base_batch_size: int, global_batch_size: int | None, distribution: Any
) -> int:
    if global_batch_size is not None:
        return global_batch_size
    if distribution is None:
        distribution = active_distribution()
    if distribution is None:
        raise ValueError(
            "The global batch is not known: no distribution is active and none "
            "was given. Pass `global_batch_size=` (the `batch_size` you give "
            "`fit`, which keras_dist splits between the replicas) or "
            "`distribution=` (then each replica gets `base_batch_size` rows). "
            "Received: global_batch_size=None, distribution=None"
        )
    if not isinstance(distribution, KerasDistribution):
        raise TypeError(
            "`distribution` must be a keras_dist (or Keras) Distribution such as "
            f"keras_dist.DataParallel(). Received: distribution={distribution!r}"
        )
    return base_batch_size * _data_parallel_replicas(distribution)


def scale_learning_rate(
    learning_rate: float,
    rule: str = "linear",
    *,
    base_batch_size: int,
    global_batch_size: int | None = None,
    distribution: Any = None,
) -> float:
    """`learning_rate`, tuned for `base_batch_size`, scaled to the global batch.

    "linear" multiplies it by `global_batch_size / base_batch_size`, "sqrt" by
    the square root of that ratio.

    Args:
        learning_rate: the learning rate tuned for `base_batch_size` rows.
        rule: "linear" or "sqrt".
        base_batch_size: the batch `learning_rate` was tuned for.
        global_batch_size: the `batch_size` given to `fit` (keras_dist's
            batch is global). Defaults to `base_batch_size` times the
            data-parallel replicas of `distribution`.
        distribution: for the default global batch; defaults to the active
            one (`keras_dist.distribution()`). Without either, and without
            `global_batch_size`, a `ValueError` says what to pass.

    Returns:
        The scaled learning rate, a Python float.

    Example:

    >>> keras_dist.scale_learning_rate(0.1, base_batch_size=256,
    ...                                global_batch_size=1024)
    0.4
    >>> keras_dist.scale_learning_rate(0.001, "sqrt", base_batch_size=64,
    ...                                global_batch_size=256)
    0.002
    """
    global_batch_size = _checked_global_batch_size(
        rule, base_batch_size, global_batch_size, distribution
    )
    return float(learning_rate) * _factor(rule, base_batch_size, global_batch_size)


def _checked_global_batch_size(
    rule: Any, base_batch_size: Any, global_batch_size: Any, distribution: Any
) -> int:
    _check_rule(rule)
    check_positive_int("base_batch_size", base_batch_size)
    check_positive_int("global_batch_size", global_batch_size, optional=True)
    return _global_batch_size(base_batch_size, global_batch_size, distribution)


def _factor(rule: str, base_batch_size: int, global_batch_size: int) -> float:
    ratio = global_batch_size / base_batch_size
    return ratio if rule == "linear" else math.sqrt(ratio)


@keras.saving.register_keras_serializable(package="keras_dist")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warmup to a learning rate (optionally scaled to the global
    batch), then that learning rate or schedule.

    At step `s < warmup_steps` the rate is `initial_learning_rate + (peak -
    initial_learning_rate) * s / warmup_steps`, where `peak` is the target
    rate (a schedule's value at its step 0); from `warmup_steps` on it is the
    target: a constant, or `learning_rate(s - warmup_steps)` for a schedule
    (which starts when the warmup ends). With `base_batch_size`, the target
    is scaled to the global batch as `scale_learning_rate` does; the global
    batch is resolved when the schedule is made and saved in its config.

    Args:
        learning_rate: the target: a float, or a Keras `LearningRateSchedule`
            to follow after the warmup.
        warmup_steps: optimizer steps of warmup (0: none).
        initial_learning_rate: the rate at step 0. Goyal et al. start from
            the unscaled rate (pass the same value as `learning_rate`).
        base_batch_size: the batch `learning_rate` was tuned for; `None`
            (default) leaves the target unscaled.
        rule: "linear" or "sqrt", with `base_batch_size`.
        global_batch_size: with `base_batch_size`: the `batch_size` given to
            `fit`. Defaults to `base_batch_size` times the data-parallel
            replicas of `distribution`.
        distribution: for the default global batch; defaults to the active
            one.

    Example:

    >>> schedule = keras_dist.schedules.LinearWarmup(
    ...     0.1, warmup_steps=4, base_batch_size=256, global_batch_size=1024)
    >>> [round(float(schedule(step)), 3) for step in range(6)]
    [0.0, 0.1, 0.2, 0.3, 0.4, 0.4]
    >>> optimizer = keras.optimizers.SGD(learning_rate=schedule)
    """

    def __init__(
        self,
        learning_rate: Any,
        warmup_steps: int,
        *,
        initial_learning_rate: float = 0.0,
        base_batch_size: int | None = None,
        rule: str = "linear",
        global_batch_size: int | None = None,
        distribution: Any = None,
    ):
        super().__init__()
        if not isinstance(
            learning_rate, keras.optimizers.schedules.LearningRateSchedule
        ):
            if isinstance(learning_rate, bool) or not isinstance(
                learning_rate, (int, float)
            ):
                raise TypeError(
                    "`learning_rate` must be a float or a Keras "
                    f"LearningRateSchedule. Received: learning_rate={learning_rate!r}"
                )
            learning_rate = float(learning_rate)
        if (
            isinstance(warmup_steps, bool)
            or not isinstance(warmup_steps, int)
            or warmup_steps < 0
        ):
            raise ValueError(
                "`warmup_steps` must be an int >= 0. Received: "
                f"warmup_steps={warmup_steps!r}"
            )
        if isinstance(initial_learning_rate, bool) or not isinstance(
            initial_learning_rate, (int, float)
        ):
            raise TypeError(
                "`initial_learning_rate` must be a float. Received: "
                f"initial_learning_rate={initial_learning_rate!r}"
            )
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.initial_learning_rate = float(initial_learning_rate)
        self.base_batch_size = base_batch_size
        self.rule = rule
        self.factor = 1.0
        if base_batch_size is not None:
            global_batch_size = _checked_global_batch_size(
                rule, base_batch_size, global_batch_size, distribution
            )
            self.factor = _factor(rule, base_batch_size, global_batch_size)
        else:
            _check_rule(rule)
            if global_batch_size is not None:
                raise ValueError(
                    "`global_batch_size` scales the learning rate only with "
                    "`base_batch_size`, the batch it was tuned for. Received: "
                    f"global_batch_size={global_batch_size!r}, base_batch_size=None"
                )
        self.global_batch_size = global_batch_size

    def _target(self, step: Any) -> Any:
        if isinstance(self.learning_rate, float):
            return ops.convert_to_tensor(self.learning_rate * self.factor, "float32")
        return ops.cast(self.learning_rate(step), "float32") * self.factor

    def __call__(self, step: Any) -> Any:
        step = ops.convert_to_tensor(step)
        after = self._target(ops.maximum(step - self.warmup_steps, 0))
        if self.warmup_steps == 0:
            return after
        peak = self._target(ops.zeros_like(step))
        done = ops.cast(ops.minimum(step, self.warmup_steps), "float32")
        ramp = self.initial_learning_rate + (peak - self.initial_learning_rate) * (
            done / self.warmup_steps
        )
        return ops.where(step < self.warmup_steps, ramp, after)

    def get_config(self) -> dict[str, Any]:
        learning_rate = self.learning_rate
        if not isinstance(learning_rate, float):
            learning_rate = keras.optimizers.schedules.serialize(learning_rate)
        return {
            "learning_rate": learning_rate,
            "warmup_steps": self.warmup_steps,
            "initial_learning_rate": self.initial_learning_rate,
            "base_batch_size": self.base_batch_size,
            "rule": self.rule,
            # Resolved when the schedule was made: the same after loading.
            "global_batch_size": self.global_batch_size,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LinearWarmup:
        config = dict(config)
        if isinstance(config["learning_rate"], dict):
            config["learning_rate"] = keras.optimizers.schedules.deserialize(
                config["learning_rate"]
            )
        learning_rate = config.pop("learning_rate")
        warmup_steps = config.pop("warmup_steps")
        return cls(learning_rate, warmup_steps, **config)
