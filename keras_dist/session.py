"""Turning a distribution on and off for one model's fit/evaluate/predict."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import keras

from keras_dist._keras_compat import (
    FILE_WRITING_CALLBACKS,
    KerasDistribution,
    save_to_scratch,
    silence_callbacks,
)
from keras_dist.backends import get_adapter
from keras_dist.policies import Distribution

_active_runs: dict[int, DistributedRun] = {}


def check_distribution(distribution: Any, owner: str) -> Distribution:
    if not isinstance(distribution, Distribution):
        hint = ""
        if isinstance(distribution, KerasDistribution):
            hint = (
                " Keras' own policies are not enough on every backend; build the "
                "same one from keras_dist, e.g. keras_dist.DataParallel(...)."
            )
        raise TypeError(
            f"{owner} needs a keras_dist Distribution such as "
            f"keras_dist.DataParallel or keras_dist.ModelParallel.{hint} "
            f"Received: {distribution!r} of type {type(distribution).__name__}"
        )
    return distribution


class DistributedRun:
    """`distribution` made active for `model` until `stop()`.

    While active the distribution is the global one (Keras sees it too), the
    model's existing variables carry its layouts and the backend adapter routes
    the model's batches and steps.
    """

    def __init__(self, model: Any, distribution: Distribution):
        self.model = model
        self.distribution = distribution
        self._previous: Any = None
        self._undo: list[Callable[[], None]] = []  # run in reverse by `stop`
        self.active = False

    def start(self) -> DistributedRun:
        key = id(self.model)
        if key in _active_runs:
            raise RuntimeError(
                f"A distribution is already active for model {self.model.name!r}; "
                "use one DistributeCallback per fit/evaluate/predict call."
            )
        self._previous = keras.distribution.distribution()
        keras.distribution.set_distribution(self.distribution)
        try:
            get_adapter().activate(self.model, self.distribution)
        except BaseException:
            keras.distribution.set_distribution(self._previous)
            raise
        _active_runs[key] = self
        self.active = True
        # One voice: only process 0 shows progress bars and per-epoch logs and
        # writes CSV logs and TensorBoard events; the others save checkpoints
        # to a scratch directory (saving is collective) that is deleted.
        if get_adapter().process_id() != 0:
            quiet = not os.environ.get("KERAS_DIST_VERBOSE_ALL_PROCESSES")
            classes = FILE_WRITING_CALLBACKS
            if quiet:
                classes = (*classes, keras.callbacks.ProgbarLogger)
            self._undo.append(silence_callbacks(classes))
            self._undo.append(save_to_scratch(self.model))
            if quiet and keras.config.is_interactive_logging_enabled():
                keras.config.disable_interactive_logging()
                self._undo.append(keras.config.enable_interactive_logging)
        return self

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        _active_runs.pop(id(self.model), None)
        while self._undo:
            self._undo.pop()()
        try:
            get_adapter().deactivate(self.model)
        finally:
            keras.distribution.set_distribution(self._previous)


def active_run(model: Any) -> DistributedRun | None:
    """The run active for `model`, if any."""
    return _active_runs.get(id(model))
