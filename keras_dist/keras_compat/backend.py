"""Keras' per-backend modules and classes, wherever this Keras keeps them.

Keras 3.16 moved each backend's op modules (`core`, `numpy`, `nn`...) from
`keras.src.backend.<name>/` into `keras.src.backend.<name>/ops/`, and renamed
the backend trainer classes (`JAXTrainer`, `TorchTrainer`,
`TensorFlowTrainer`) to `Trainer`. keras_dist finds them by what the installed
Keras has, never by its version number:

- an op module is `keras.src.backend.<name>.ops.<module>` when that exists,
  else `keras.src.backend.<name>.<module>`;
- the trainer class is the base of `keras.Model` defined in the backend's
  `trainer` module (`keras.Model` picks it by backend);
- the epoch iterator class is the `EpochIterator` subclass that module defines.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import keras

from keras_dist.keras_compat.versions import unsupported


def ops_module(backend: str, name: str = "core") -> ModuleType:
    """Keras' op module `name` (`"core"`, `"numpy"`...) of `backend`.

    Raises:
        UnsupportedKerasError: when this Keras has it in neither place.
    """
    for candidate in (
        f"keras.src.backend.{backend}.ops.{name}",
        f"keras.src.backend.{backend}.{name}",
    ):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as error:
            # Only the module itself may be missing; an error inside it is real.
            if error.name is None or not candidate.startswith(error.name):
                raise
    raise unsupported(
        f"it has no module {name!r} for the {backend} backend (looked for "
        f"keras.src.backend.{backend}.ops.{name} and "
        f"keras.src.backend.{backend}.{name})"
    )


def variable_class(backend: str) -> type:
    """The class of the backend's core module that `keras.Variable` derives
    from, whose methods keras_dist wraps: JAX's `JaxVariable` up to Keras 3.15
    (and under NNX in 3.16, where it is the non-NNX base), else `Variable`.

    Raises:
        UnsupportedKerasError: when the core module has no such class.
    """
    core = ops_module(backend)
    for name in ("JaxVariable", "Variable"):
        candidate = getattr(core, name, None)
        if inspect.isclass(candidate) and issubclass(keras.Variable, candidate):
            return candidate
    raise unsupported(
        f"keras.Variable derives from no variable class of {core.__name__}"
    )


def trainer_module(backend: str) -> ModuleType:
    """`keras.src.backend.<backend>.trainer`."""
    return importlib.import_module(f"keras.src.backend.{backend}.trainer")


def trainer_class(backend: str) -> type:
    """The backend's trainer class (`JAXTrainer`... up to Keras 3.15,
    `Trainer` from 3.16): the base of `keras.Model` that the backend's trainer
    module defines, which is the one `keras.Model` trains with when `backend`
    is the active backend; else the module's own subclass of Keras' base
    trainer.

    Raises:
        UnsupportedKerasError: when the module defines no such class.
    """
    module = trainer_module(backend)
    for cls in keras.Model.__mro__:
        if cls.__module__ == module.__name__:
            return cls
    base = importlib.import_module("keras.src.trainers.trainer")
    bases = tuple(
        value
        for value in vars(base).values()
        if inspect.isclass(value) and value.__module__ == base.__name__
    )
    found = _subclass_defined_in(module, bases)
    if found is None:
        raise unsupported(f"its {module.__name__} defines no trainer class")
    return found


def epoch_iterator_class(backend: str) -> type:
    """The backend's epoch iterator (`JAXEpochIterator`, `TorchEpochIterator`,
    `TFEpochIterator`): the subclass of Keras' `EpochIterator` that the
    backend's trainer module defines.

    Raises:
        UnsupportedKerasError: when the module defines none.
    """
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    found = _subclass_defined_in(trainer_module(backend), (EpochIterator,))
    if found is None:
        raise unsupported(
            f"its {trainer_module(backend).__name__} defines no EpochIterator"
        )
    return found


def _subclass_defined_in(module: ModuleType, bases: tuple[type, ...]) -> type | None:
    """The first class `module` itself defines that subclasses one of `bases`."""
    for value in vars(module).values():
        if (
            inspect.isclass(value)
            and value.__module__ == module.__name__
            and issubclass(value, bases)
        ):
            return value
    return None


def check() -> list[str]:
    """What the active backend's adapter needs found: its `core` module, its
    trainer class, its epoch iterator."""
    backend = keras.backend.backend()
    missing = []
    for what, find in (
        (f"keras.src.backend.{backend}[.ops].core", lambda: ops_module(backend)),
        (f"the {backend} variable class", lambda: variable_class(backend)),
        (f"the {backend} trainer class", lambda: trainer_class(backend)),
        (f"the {backend} epoch iterator", lambda: epoch_iterator_class(backend)),
    ):
        try:
            find()
        except ImportError:
            missing.append(what)
    return missing
