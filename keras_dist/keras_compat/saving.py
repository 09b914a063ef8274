"""Keras' saving functions (one writer in a multi-process job) and the walk
behind `.weights.h5` (the checkpoint keys, `keras_dist.checkpoint.keys`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import keras

# -- one writer in a multi-process job --------------------------------------------
# Keras' functions behind `Model.save`, `Model.save_weights`, `keras.saving.*`
# and `keras.models.save_model` (the `Model` methods call them by module).
SAVING_FUNCTIONS = ("save_model", "save_weights")


def wrap_saving_functions(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]):
    """Replace Keras' `save_model(model, filepath, ...)` and
    `save_weights(model, filepath, ...)` with `wrap(original)`, wherever Keras
    exports them (idempotent)."""
    from keras.src.saving import saving_api  # noqa: PLC0415

    for name in SAVING_FUNCTIONS:
        original = getattr(saving_api, name)
        if getattr(original, "_keras_dist_wrapped", False):
            continue
        wrapped = wrap(original)
        wrapped._keras_dist_wrapped = True
        setattr(saving_api, name, wrapped)
        for namespace in (keras.saving, keras.models):
            if getattr(namespace, name, None) is original:
                setattr(namespace, name, wrapped)


def tolerate_existing_directories() -> None:
    """Let Keras' `file_utils.makedirs` accept a directory that appeared after
    its caller checked (idempotent).

    `ModelCheckpoint` creates its directory when `exists()` says it is not
    there; every process of a job does that at the same step, and all but the
    first would fail with `FileExistsError`.
    """
    from keras.src.utils import file_utils  # noqa: PLC0415

    original = file_utils.makedirs
    if getattr(original, "_keras_dist_wrapped", False):
        return

    def makedirs(path: Any) -> Any:
        try:
            return original(path)
        except FileExistsError:
            if file_utils.isdir(path):
                return None
            raise

    makedirs._keras_dist_wrapped = True
    file_utils.makedirs = makedirs


# -- the structural walk of `.weights.h5` ---------------------------------------
def saveable_children(saveable: Any) -> Iterator[tuple[str, Any]]:
    """`(attribute, child)` for what Keras' saving walks into from
    `saveable`, in its order (`saving_lib._walk_saveable`)."""
    from keras.src.saving import saving_lib  # noqa: PLC0415

    return iter(saving_lib._walk_saveable(saveable))


def is_saveable(value: Any) -> bool:
    """Whether Keras' saving walks into `value` (a `KerasSaveable`)."""
    from keras.src.saving.keras_saveable import KerasSaveable  # noqa: PLC0415

    return isinstance(value, KerasSaveable)


def container_item_name(item: Any, used: dict[str, int]) -> str:
    """The name Keras' saving gives `item` inside a list or dict (its class
    name in snake case, numbered when repeated; `"container"` for a nested
    container), counting in `used`."""
    from keras.src.saving import saving_lib  # noqa: PLC0415
    from keras.src.utils import naming  # noqa: PLC0415

    base = "container"
    if is_saveable(item):
        base = naming.to_snake_case(item.__class__.__name__)
    return saving_lib._get_unique_name(base, used)


def check() -> list[str]:
    """What `wrap_saving_functions`, `tolerate_existing_directories` and the
    structural walk need."""
    from keras.src.saving import saving_api, saving_lib  # noqa: PLC0415

    missing = []
    for name in SAVING_FUNCTIONS:
        function = getattr(saving_api, name, None)
        function = getattr(function, "__wrapped__", function)
        parameters = list(inspect.signature(function).parameters)
        if parameters[:2] != ["model", "filepath"]:
            missing.append(f"keras.src.saving.saving_api.{name}(model, filepath)")
    for method, name in (
        (keras.Model.save, "save_model"),
        (keras.Model.save_weights, "save_weights"),
    ):
        if f"saving_api.{name}(" not in inspect.getsource(method):
            missing.append(f"Model.{method.__name__} calls saving_api.{name}")
    for name in ("_walk_saveable", "_get_unique_name"):
        if not callable(getattr(saving_lib, name, None)):
            missing.append(f"keras.src.saving.saving_lib.{name}")
    from keras.src.callbacks import model_checkpoint  # noqa: PLC0415
    from keras.src.utils import file_utils  # noqa: PLC0415

    if getattr(model_checkpoint, "file_utils", None) is not file_utils or not callable(
        getattr(file_utils, "makedirs", None)
    ):
        missing.append("ModelCheckpoint creates directories with file_utils.makedirs")
    return missing
