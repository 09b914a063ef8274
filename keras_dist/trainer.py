"""`Trainer`: a mixin that makes a Keras model train under a distribution."""

from __future__ import annotations

import inspect
import os
from typing import Any

import keras

from keras_dist.callback import DistributeCallback
from keras_dist.checkpoint import Checkpoint
from keras_dist.distribution.policies import Distribution
from keras_dist.training import auto
from keras_dist.training.session import active_run, check_distribution


class Trainer:
    """Mixin for `keras.Model` subclasses: `fit`, `evaluate` and `predict` run
    under a keras_dist distribution.

    The distribution is the one given to the constructor as `distribution=`
    (`"auto"` or `keras_dist.Auto(...)`: keras_dist chooses when the first
    call starts, as `DistributeCallback("auto")` does), else the keras_dist
    distribution that is global when the call starts
    (`keras_dist.set_distribution` or `with distribution.scope():`). Without
    one the model trains as plain Keras would.

    `checkpoint=` (a directory, or a `keras_dist.Checkpoint` for its options)
    makes every `fit` save with that `Checkpoint` and resume from its latest
    checkpoint, as if it were in `fit`'s callbacks (it then must not be).

    Example:

    ```python
    class Net(keras_dist.Trainer, keras.Model):
        ...

    model = Net(distribution=keras_dist.DataParallel(), checkpoint="checkpoints")
    # Functional models work too:
    class Functional(keras_dist.Trainer, keras.Model):
        ...  # nothing to add: the mixin does the work

    model = Functional(inputs, outputs, distribution=keras_dist.DataParallel())
    ```
    """

    def __init__(
        self,
        *args: Any,
        distribution: Distribution | None = None,
        checkpoint: str | os.PathLike | Checkpoint | None = None,
        **kwargs: Any,
    ):
        if distribution is not None and not auto.is_auto(distribution):
            check_distribution(distribution, "Trainer(distribution=...)")
        if isinstance(checkpoint, str | os.PathLike):
            checkpoint = Checkpoint(checkpoint)
        elif checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "`Trainer(checkpoint=...)` takes a directory (str or os.PathLike) "
                "or a `keras_dist.Checkpoint`. Received: "
                f"{checkpoint!r} of type {type(checkpoint).__name__}"
            )
        super().__init__(*args, **kwargs)
        self._keras_dist_distribution = distribution
        self._keras_dist_checkpoint = checkpoint

    @property
    def distribution(self) -> Distribution | None:
        """The distribution `fit`/`evaluate`/`predict` will use, if any; with
        `distribution="auto"` the one chosen once a call has started (before
        it, `"auto"` or the `keras_dist.Auto` given)."""
        given = self._keras_dist_distribution
        if auto.is_auto(given):
            choice = auto.choice_of(self)
            return given if choice is None else choice.distribution
        if self._keras_dist_distribution is not None:
            return self._keras_dist_distribution
        current = keras.distribution.distribution()
        return current if isinstance(current, Distribution) else None

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The `keras_dist.Checkpoint` that `fit` saves with and resumes from,
        if one was given as `checkpoint=`."""
        return self._keras_dist_checkpoint

    @property
    def choice(self) -> auto.Choice | None:
        """With `distribution="auto"`: the row of the choice made when the
        first call started (None before it)."""
        return auto.choice_of(self)

    def _run_distributed(
        self, method: Any, args: tuple, kwargs: dict, checkpoint: Any = None
    ) -> Any:
        distribution = self._keras_dist_distribution or self.distribution
        bound = inspect.signature(method).bind(*args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        if checkpoint is not None:
            _check_one_checkpoint(callbacks)
        if (
            distribution is None
            or active_run(self) is not None
            or isinstance(callbacks, keras.callbacks.CallbackList)
        ):
            if checkpoint is None:
                return method(*args, **kwargs)
            bound.arguments["callbacks"] = [*(callbacks or []), checkpoint]
            return method(*bound.args, **bound.kwargs)
        callback = DistributeCallback(distribution)
        added = [callback] if checkpoint is None else [callback, checkpoint]
        bound.arguments["callbacks"] = [*(callbacks or []), *added]
        try:
            return method(*bound.args, **bound.kwargs)
        finally:
            callback.close()

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(
            super().fit, args, kwargs, checkpoint=self._keras_dist_checkpoint
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(super().evaluate, args, kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(super().predict, args, kwargs)


def _check_one_checkpoint(callbacks: Any) -> None:
    """`fit(callbacks=...)` of a Trainer given `checkpoint=`: a list (or
    None) without a `keras_dist.Checkpoint` of its own."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        raise ValueError(
            "A Trainer given `checkpoint=` adds its `keras_dist.Checkpoint` to "
            "`fit`'s callbacks, which must then be a list, not a "
            "`keras.callbacks.CallbackList`. Pass a list of callbacks."
        )
    if any(isinstance(callback, Checkpoint) for callback in callbacks or []):
        raise ValueError(
            "This Trainer was given `checkpoint=` and `fit(callbacks=...)` holds "
            "a `keras_dist.Checkpoint` too: use one or the other (drop "
            "`checkpoint=` from the constructor, or the Checkpoint from "
            "`callbacks`)."
        )
