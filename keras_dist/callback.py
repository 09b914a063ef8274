"""`DistributeCallback`: a distribution for one `fit`, `evaluate` or `predict`."""

from __future__ import annotations

from typing import Any

import keras

from keras_dist.faults import heartbeat
from keras_dist.training import auto
from keras_dist.training.session import DistributedRun, check_distribution

_MODES = ("train", "test", "predict")


class DistributeCallback(keras.callbacks.Callback):
    """Run `fit`, `evaluate` or `predict` under `distribution`.

    The distribution becomes active when Keras hands the model to its callbacks,
    before the first step is compiled: variables that already exist are laid
    out then, variables created later get their layout at creation, and every
    batch is split between the devices (a last batch that does not divide is
    padded and the padding masked out). It is switched off when the call that
    started it ends, also when the call raises (keras_dist then leaves nothing
    behind: the next call, of this model or another, keras_dist or plain
    Keras, runs as it would have without the failed one); validation inside
    `fit` stays distributed.

    `"auto"` (or a `keras_dist.Auto`) lets keras_dist choose: when the call
    starts, before any step compiles, it compiles the candidates for this
    job's devices (JAX) or reads the static plan (PyTorch, TensorFlow),
    takes the fastest projected one that fits, says so in one line on
    process 0 (with the code that pins it; `verbose=0` silences it) and
    trains with it. `callback.distribution` is then the distribution chosen
    and `callback.choice` its row (`keras_dist.planner.auto_choice.Choice`);
    later calls of the same model reuse it. Nothing fits:
    `keras_dist.OutOfDeviceMemoryError` before any step.

    Args:
        distribution: a keras_dist `DataParallel`, `ModelParallel` or `FSDP`,
            or `"auto"` / `keras_dist.Auto(...)`.

    Example:

    ```python
    distribution = keras_dist.DataParallel()
    callback = keras_dist.DistributeCallback(distribution)
    model.fit(x, y, batch_size=64, callbacks=[callback])
    ```
    """

    # The run it starts needs `training.session` from the call's start on.
    starts_runs = True

    def __init__(self, distribution: Any):
        super().__init__()
        self.auto: auto.Auto | None = None
        #: The row of the choice `"auto"` made (None until a call starts).
        self.choice: auto.Choice | None = None
        self._chosen_for: Any = None
        # The word "auto" reuses any choice made for the model before.
        self._as_word = isinstance(distribution, str)
        if auto.is_auto(distribution):
            self.auto = auto.as_auto(distribution)
            self.distribution = None
        else:
            self.distribution = check_distribution(distribution, "DistributeCallback")
        self._run: DistributedRun | None = None
        self._owner: str | None = None

    def choose_for_call(self, model: Any, name: str, arguments: dict) -> None:
        """With `"auto"`: choose for `model` as its call `name` starts (the
        call's `arguments` give the batch); a choice made for this model is
        kept."""
        if self.auto is None or self._chosen_for is model:
            return
        self.choice = auto.choose(
            model, name, arguments, self.auto, any_earlier=self._as_word
        )
        self.distribution = self.choice.distribution
        self._chosen_for = model

    def set_model(self, model: Any) -> None:
        if self.auto is not None and self._chosen_for is not model:
            raise RuntimeError(
                'DistributeCallback("auto") chooses when a Keras fit, evaluate or '
                "predict of the model starts: pass it in that call's callbacks "
                "(set_model by hand needs a concrete distribution). Received: "
                f"model {model.name!r}"
            )
        super().set_model(model)
        # A run this callback started outside any Keras call (`set_model`
        # called by hand) is still on; a call's run ends with the call.
        self.close()
        self._run = DistributedRun(model, self.distribution).start()

    def close(self) -> None:
        """Switch the distribution off now; idempotent. Not needed after a
        call that raised: the call switched it off as it ended."""
        if self._run is not None:
            run, self._run, self._owner = self._run, None, None
            run.stop()

    def _begin(self, mode: str) -> None:
        if self._owner is None:
            self._owner = mode
        if self._run is not None:
            # The hang doctor follows the call's steps (phase and progress).
            heartbeat.begin_call(self.model, mode)

    def _end(self, mode: str) -> None:
        if self._run is not None:
            heartbeat.end_call(self.model)
        if self._owner == mode:
            self.close()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        heartbeat.begin_epoch(epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # A step that failed on a device ends `fit` at this epoch's end, not
        # after every later epoch (JAX runs steps asynchronously).
        if self._run is not None:
            self._run.wait_for_steps()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._begin("train")

    def on_train_end(self, logs: dict | None = None) -> None:
        self._end("train")

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._begin("test")

    def on_test_end(self, logs: dict | None = None) -> None:
        self._end("test")

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._begin("predict")

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._end("predict")
