"""Turning a distribution on and off for one model's fit/evaluate/predict."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_dist import keras_compat
from keras_dist.backends import get_adapter
from keras_dist.distribution.layer_settings import apply_layer_settings
from keras_dist.distribution.layout_map import LayoutMap, bind_layout_map
from keras_dist.distribution.policies import Distribution, ModelParallel
from keras_dist.distribution.sequence import check_model
from keras_dist.faults import heartbeat
from keras_dist.keras_compat.callbacks import silence_callbacks
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.model_calls import values_kept
from keras_dist.runtime.join_check import require_joined
from keras_dist.training import out_of_memory, saving

_active_runs: dict[int, DistributedRun] = {}


class KerasCall:
    """One Keras `fit`, `evaluate` or `predict` in progress."""

    def __init__(self, name: str):
        self.name = name
        # The distribution of the run started during the call, if one was.
        self.distribution: Distribution | None = None


# One per Keras fit/evaluate/predict in progress, innermost last.
_calls_in_progress: list[KerasCall] = []


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
        # The Keras call that started the run (None: started outside any).
        self._call: KerasCall | None = None

    def start(self) -> DistributedRun:
        key = id(self.model)
        if key in _active_runs:
            raise RuntimeError(
                f"A distribution is already active for model {self.model.name!r}; "
                "use one DistributeCallback per fit/evaluate/predict call."
            )
        # Before anything: a process a launcher started as one of several that
        # never called `kd.initialize()` must neither train alone nor write.
        call = _calls_in_progress[-1] if _calls_in_progress else None
        require_joined(f"`{call.name}`" if call else "this call")
        # Before anything changes: a layout map for another model fails here.
        _check_layout_keys(self.model, self.distribution)
        # One writer: process 0 writes every file (`keras_dist.saving`), for
        # a job whose processes did not join through `keras_dist.initialize()`.
        saving.install()
        # Each process' heartbeat, for the hang doctor (several processes).
        adapter = get_adapter()
        heartbeat.start(
            rank=adapter.process_id(),
            world_size=adapter.num_processes(),
            collective_trace=adapter.collective_trace,
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
        try:
            self._undo.append(
                apply_layer_settings(
                    self.model,
                    self.distribution,
                    warn=adapter.process_id() == 0,
                    recomputes_state=adapter.recomputes_layer_state,
                )
            )
        except BaseException:
            self.stop()
            raise
        self._call = call
        if call is not None:
            call.distribution = self.distribution
        # One voice: only process 0 shows progress bars and per-epoch logs.
        # (Files, from checkpoints to CSV logs and TensorBoard events, are
        # written by process 0 whether a run is active or not: `saving`.)
        if get_adapter().process_id() != 0:
            quiet = not os.environ.get("KERAS_DIST_VERBOSE_ALL_PROCESSES")
            if quiet:
                self._undo.append(silence_callbacks((keras.callbacks.ProgbarLogger,)))
            if quiet and keras.config.is_interactive_logging_enabled():
                keras.config.disable_interactive_logging()
                self._undo.append(keras.config.enable_interactive_logging)
        return self

    @property
    def stale(self) -> bool:
        """Whether the run outlived the Keras call that started it, or was
        started outside any (a callback's `set_model` called by hand): the
        next Keras call, on any model, stops it first."""
        return self.active and self._call not in _calls_in_progress

    def wait_for_steps(self) -> None:
        """Return once every step dispatched so far has run: a step that
        failed on a device raises here (JAX dispatches asynchronously)."""
        if self.active:
            get_adapter().wait_for_steps(self.model)

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        _active_runs.pop(id(self.model), None)
        # Before the undo: it keeps the compiled steps, which must be Keras'.
        heartbeat.end_calls(self.model)
        try:
            while self._undo:
                self._undo.pop()()
        finally:
            try:
                get_adapter().deactivate(self.model)
            finally:
                keras.distribution.set_distribution(self._previous)


_warned_keys: set[tuple[int, str]] = set()


def _check_layout_keys(model: Any, distribution: Any) -> None:
    """Bind a keras_dist LayoutMap to `model` (`LayoutMap.bind`), then check
    its keys against the built model's variables and layer outputs.

    A map none of whose keys matches anything was written for another model
    (or each key has a typo): the run would lay out nothing and train as
    data parallel, so it is a `ValueError`, on every process. A key that
    matches nothing while others match is named in a warning, once, on
    process 0: maps written for a family of models (KerasHub's) carry keys
    for layers some configurations lack."""
    if not isinstance(distribution, ModelParallel):
        return
    bind_layout_map(distribution, model)
    keys = list(distribution.layout_map)
    if not keys or not model.variables:
        return
    paths = [variable.path for variable in model.variables]
    paths += [f"{layer.path}/output" for layer in layers_of(model) if layer.path]
    unmatched = distribution.unmatched_keys(paths)
    layout_map = distribution.layout_map
    if isinstance(layout_map, LayoutMap):
        seen = [layout_map.lookup_path(path) for path in paths]
    else:
        seen = paths
    if len(unmatched) == len(keys):
        shown = ", ".join(repr(key) for key in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        raise ValueError(
            f"None of the {len(keys)} LayoutMap keys ({shown}{more}) matches a "
            f"variable or layer output of model {model.name!r}, whose variable "
            f"paths are like {seen[:3]}: the map was written for another "
            "model, and the run would lay out nothing and train as data "
            "parallel. Write keys that match these paths (regular expressions "
            "searched in each path), or make the map from this model, e.g. "
            "keras_dist.layouts.tensor_parallel(model, mesh)."
        )
    if get_adapter().process_id() != 0:
        return
    for key in unmatched:
        if (id(distribution), key) in _warned_keys:
            continue
        _warned_keys.add((id(distribution), key))
        warnings.warn(
            f"LayoutMap key {key!r} matches no variable of model {model.name!r} "
            "and no layer output, so its layout is used nowhere. Variable paths "
            f"look like {seen[0]!r}; check the key for typos.",
            UserWarning,
            stacklevel=4,
        )


def active_run(model: Any) -> DistributedRun | None:
    """The run active for `model`, if any (a stale one does not count)."""
    run = _active_runs.get(id(model))
    return None if run is None or run.stale else run


def _distribution_in(callbacks: Any) -> Distribution | None:
    """The distribution of the first `DistributeCallback` among a call's
    callbacks (a list or a `CallbackList`), if any: a callback class that
    starts a run for its `distribution` says so with `starts_runs = True`."""
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        if getattr(type(callback), "starts_runs", False):
            return callback.distribution
    return None


def _choose_for_call(model: Any, name: str, callbacks: Any, arguments: Any) -> None:
    """A `DistributeCallback` asked to choose (`"auto"`) chooses now, when
    the call starts, from the call's arguments: before anything reads its
    distribution, Keras builds the model or a step is compiled."""
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        if getattr(type(callback), "starts_runs", False):
            choose = getattr(callback, "choose_for_call", None)
            if choose is not None:
                choose(model, name, dict(arguments or {}))
            return


@contextlib.contextmanager
def _runs_end_with_their_call(
    model: Any, name: str = "fit", callbacks: Any = None, arguments: Any = None
) -> Iterator[None]:
    """A run started during a Keras call on `model` (by a `DistributeCallback`)
    ends with that call, also when it raises: Keras calls no callback then,
    and the run's patches, global distribution and steps would stay behind
    for the next call of this model or any other. With a `DistributeCallback`
    among `callbacks`, the backend adapter's `call_starting` is around the
    whole call (Keras builds the optimizer before the run starts), and
    around any call without one (the model may hold what a run left split).

    A distributed call returns only once its steps have run: a step that
    failed on a device (JAX dispatches asynchronously, and with `verbose=0`
    nothing reads a step's results) raises before the call returns, through
    the same handling as an error raised during the call."""
    for stale in [run for run in _active_runs.values() if run.stale]:
        stale.stop()
    if id(model) not in _active_runs:
        _choose_for_call(model, name, callbacks, arguments)
    given = _distribution_in(callbacks)
    # Before Keras builds the model or compiles a step (`sequence_axis=`).
    check_model(model, given)
    starting = (
        get_adapter().call_starting(model, name, given)
        if id(model) not in _active_runs
        else contextlib.nullcontext()
    )
    before = _active_runs.get(id(model))
    token = KerasCall(name)
    with starting:
        _calls_in_progress.append(token)
        try:
            # Innermost: the variables hold their values again before the
            # error is explained or the run stops (Keras' JAX trainer
            # detaches them for its steps).
            with values_kept(model):
                yield
            run = _active_runs.get(id(model))
            if token.distribution is not None or run is not None:
                # The run may have ended with the call (on_train_end).
                get_adapter().wait_for_steps(model)
        except Exception as error:
            # The run, the one the call started (and ended), or the
            # DistributeCallback of a call whose run had not started yet
            # (Keras builds the optimizer's slots before it).
            run = _active_runs.get(id(model))
            distribution = run.distribution if run else token.distribution or given
            if distribution is None or not out_of_memory.is_out_of_memory(error):
                raise
            if run is not None and run is not before:
                # Ended before the step is compiled again for the message:
                # the compile lays the model's steps out on its own.
                run.stop()
            # The engine's words name buffers; the plan names the model's.
            raise out_of_memory.OutOfDeviceMemoryError(
                out_of_memory.explain(model, distribution, name, str(error))
                + f"\n\nThe engine said: {str(error)[:2000]}"
            ) from error
        finally:
            _calls_in_progress.remove(token)
            run = _active_runs.get(id(model))
            if run is not None and run is not before:
                run.stop()


# What importing keras_dist patches in Keras (listed in `keras_compat`).
keras_compat.patch_keras(around_model_calls=_runs_end_with_their_call)
