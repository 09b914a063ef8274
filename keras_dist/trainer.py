"""`Trainer`: a mixin that makes a Keras model train under a distribution."""

from __future__ import annotations

import inspect
from typing import Any

import keras

from keras_dist.callback import DistributeCallback
from keras_dist.policies import Distribution
from keras_dist.session import active_run, check_distribution


class Trainer:
    """Mixin for `keras.Model` subclasses: `fit`, `evaluate` and `predict` run
    under a keras_dist distribution.

    The distribution is the one given to the constructor as `distribution=`,
    else the keras_dist distribution that is global when the call starts
    (`keras_dist.set_distribution` or `with distribution.scope():`). Without
    one the model trains as plain Keras would.

    Example:

    ```python
    class Net(keras_dist.Trainer, keras.Model):
        ...

    model = Net(distribution=keras_dist.DataParallel())
    # Functional models work too:
    class Functional(keras_dist.Trainer, keras.Model):
        ...  # nothing to add: the mixin does the work

    model = Functional(inputs, outputs, distribution=keras_dist.DataParallel())
    ```
    """

    def __init__(
        self, *args: Any, distribution: Distribution | None = None, **kwargs: Any
    ):
        if distribution is not None:
            check_distribution(distribution, "Trainer(distribution=...)")
        super().__init__(*args, **kwargs)
        self._keras_dist_distribution = distribution

    @property
    def distribution(self) -> Distribution | None:
        """The distribution `fit`/`evaluate`/`predict` will use, if any."""
        if self._keras_dist_distribution is not None:
            return self._keras_dist_distribution
        current = keras.distribution.distribution()
        return current if isinstance(current, Distribution) else None

    def _run_distributed(self, method: Any, args: tuple, kwargs: dict) -> Any:
        distribution = self.distribution
        bound = inspect.signature(method).bind(*args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        if (
            distribution is None
            or active_run(self) is not None
            or isinstance(callbacks, keras.callbacks.CallbackList)
        ):
            return method(*args, **kwargs)
        callback = DistributeCallback(distribution)
        bound.arguments["callbacks"] = [*(callbacks or []), callback]
        try:
            return method(*bound.args, **bound.kwargs)
        finally:
            callback.close()

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(super().fit, args, kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(super().evaluate, args, kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_distributed(super().predict, args, kwargs)
