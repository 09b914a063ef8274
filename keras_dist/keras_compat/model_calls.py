"""Keras' `fit`, `evaluate` and `predict`: what runs around each call."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_dist.keras_compat import backend as keras_backends

# Keras' calls that hand the model to their callbacks (`CallbackList.set_model`).
MODEL_CALLS = ("fit", "evaluate", "predict")


def run_model_calls_within(around: Callable[[Any, str, Any, dict], Any]) -> None:
    """Run every model's `fit`, `evaluate` and `predict` inside the context
    manager `around(model, name, callbacks, arguments)` (`name`: `"fit"`,
    `"evaluate"` or `"predict"`; `callbacks`: what the call was given, None
    when nothing; `arguments`: the call's arguments by name, as given: `x`,
    `batch_size`, `verbose`...), from now on (idempotent).

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
        setattr(keras.Model, name, _call_within(original, name, around))


def _call_within(
    original: Callable[..., Any],
    name: str,
    around: Callable[[Any, str, Any, dict], Any],
) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = dict(signature.bind_partial(self, *args, **kwargs).arguments)
        except TypeError:  # Keras' own call raises the clear error
            bound = dict(kwargs)
        bound.pop("self", None)
        with around(self, name, bound.get("callbacks"), bound):
            return original(self, *args, **kwargs)

    call._keras_dist_around = around  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def values_kept(model: Any) -> Iterator[None]:
    """A Keras call on `model` that raises leaves every variable of the
    model, its optimizer and its metrics holding a value.

    Keras' JAX trainer detaches the variables' values as a step's state is
    gathered (`_purge_model_variables`: the step's arrays are the only copy,
    to save memory) and writes them back at an epoch's end, in `fit`'s
    `finally` or after `evaluate`'s and `predict`'s loops. An error raised
    in the first step (a batch refused as it is laid out, a step XLA cannot
    compile, a memory error) leaves no state to write back, and `evaluate`
    and `predict` write nothing back at all when they raise: the model's
    variables are left with no value (`get_weights()` then fails inside
    Keras). Here each value detached during the call is kept; when the call
    raises, the state Keras holds from the last step that ran is written
    back (`jax_state_sync`) and every variable still without a value gets
    the one detached from it. A value a failed step consumed (donated) is
    lost: a note on the error names the variables. Backends that detach
    nothing: the block runs as it is."""
    if not callable(getattr(type(model), "_purge_model_variables", None)):
        yield
        return
    detached: dict[int, tuple[Any, Any]] = {}
    purge = model._purge_model_variables
    had_own = "_purge_model_variables" in vars(model)

    def keep_then_purge(*args: Any, **kwargs: Any) -> Any:
        for variable in _all_variables(model):
            if variable._value is not None:
                detached[id(variable)] = (variable, variable._value)
        return purge(*args, **kwargs)

    model._purge_model_variables = keep_then_purge
    try:
        yield
    except BaseException as error:
        lost = _put_back(model, detached.values())
        if lost:
            error.add_note(
                f"keras_dist could not give {len(lost)} variables of model "
                f"{model.name!r} their values back (the failed step consumed "
                f"them), e.g. {lost[0]!r}: restore the model from a checkpoint "
                "or build it again."
            )
        raise
    finally:
        if had_own:
            model._purge_model_variables = purge
        else:
            vars(model).pop("_purge_model_variables", None)


def _all_variables(model: Any) -> list[Any]:
    optimizer = getattr(model, "optimizer", None)
    return [
        *model.variables,
        *(optimizer.variables if optimizer is not None else ()),
        *model.metrics_variables,
    ]


def _usable(value: Any) -> bool:
    is_deleted = getattr(value, "is_deleted", None)
    return value is not None and not (callable(is_deleted) and is_deleted())


def _put_back(model: Any, detached: Any) -> list[str]:
    """Write back the state of the last step that ran, then each detached
    value still missing; the paths of the variables left without one."""
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        held = [value for group in state.values() for value in group or ()]
        if all(_usable(value) for value in held):
            model.jax_state_sync()
    model._jax_state, model._jax_state_synced = None, True
    lost = []
    for variable, value in detached:
        if variable._value is not None:
            continue
        if _usable(value):
            variable._value = value
        else:
            lost.append(variable.path)
    return lost


def check() -> list[str]:
    """What `run_model_calls_within` and `values_kept` need."""
    missing = []
    for name in MODEL_CALLS:
        call = getattr(keras.Model, name, None)
        target = getattr(call, "__wrapped__", call)
        if (
            not callable(target)
            or "callbacks" not in inspect.signature(target).parameters
        ):
            missing.append(f"keras.Model.{name}(..., callbacks=...)")
    if keras.backend.backend() == "jax":
        trainer = keras_backends.trainer_class("jax")
        gather = getattr(trainer, "_get_jax_state", None)
        if not callable(getattr(trainer, "jax_state_sync", None)):
            missing.append("JAXTrainer.jax_state_sync")
        if not callable(getattr(trainer, "_purge_model_variables", None)) or (
            gather is None
            or "self._purge_model_variables(" not in inspect.getsource(gather)
        ):
            missing.append("JAXTrainer._get_jax_state calls _purge_model_variables")
        if "_value" not in vars(keras.Variable(0.0)):
            missing.append("Variable._value")
    return missing
