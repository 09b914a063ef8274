"""Keras' compiled step functions: keras_dist's steps in their place, cached."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
