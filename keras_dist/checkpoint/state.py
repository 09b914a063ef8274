"""What a checkpoint holds, and putting it back into a model.

The variables go through the engines (`engine.py`) under Keras' structural
keys (`_keras_compat.saveable_variables`); everything else a resume needs
(epoch, batches done, the random generators at the epoch's start, other
callbacks' state) is plain JSON in the manifest.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.checkpoint import damaged, store
from keras_dist.checkpoint import engine as engines
from keras_dist.checkpoint.keys import saveable_variables

_METRICS = "metrics/"
_OPTIMIZER = "optimizer/"


def state_to_save(model: Any, *, weights_only: bool) -> dict[str, Any]:
    """The variables a checkpoint of `model` holds, by key."""
    state = saveable_variables(model)
    if weights_only:
        state = {
            key: variable
            for key, variable in state.items()
            if not key.startswith((_METRICS, _OPTIMIZER))
        }
    return state


def entries(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's description of each key: global shape and dtype."""
    return {
        key: {"shape": [int(d) for d in variable.shape], "dtype": str(variable.dtype)}
        for key, variable in state.items()
    }


def current_engine_name() -> str:
    return engines.backend_engine(keras.backend.backend())


def ensure_built(model: Any, saved: dict[str, Any]) -> None:
    """Build what the checkpoint has and `model` lacks yet: the optimizer's
    variables (a model that never trained)."""
    optimizer = getattr(model, "optimizer", None)
    has_optimizer_state = any(key.startswith(_OPTIMIZER) for key in saved)
    if (
        has_optimizer_state
        and optimizer is not None
        and not getattr(optimizer, "built", False)
        and model.trainable_variables
    ):
        # Its slots are made where the global distribution keeps them (in
        # host memory under `offload=`), never on the device first.
        distribution = keras.distribution.distribution()
        with get_adapter().building_optimizer(model, distribution):
            optimizer.build(model.trainable_variables)


def match(
    model: Any, manifest: dict[str, Any], where: str, *, weights_only: bool = False
) -> dict[str, Any]:
    """The variables of `model` to load from a checkpoint, by key; a
    `ValueError` naming every difference when the model does not fit it.
    Metric states the model has not built (it never trained) are left out;
    so are the optimizer and metrics for `weights_only`."""
    saved = manifest["entries"]
    if not model.built:
        raise ValueError(
            f"The model {model.name!r} is not built: build it (call it on a batch "
            f"or `model.build(input_shape)`) before restoring {where} into it."
        )
    ensure_built(model, saved)
    state = saveable_variables(model)
    skipped = (_METRICS, _OPTIMIZER) if weights_only else (_METRICS,)
    missing = [k for k in state if k not in saved and not k.startswith(skipped)]
    unused = [k for k in saved if k not in state and not k.startswith(skipped)]
    wrong = [
        f"{key}: saved {tuple(saved[key]['shape'])}, model {tuple(variable.shape)}"
        for key, variable in state.items()
        if key in saved
        and list(saved[key]["shape"]) != [int(d) for d in variable.shape]
    ]
    if missing or unused or wrong:
        lines = []
        if missing:
            lines.append(f"variables the checkpoint lacks: {missing}")
        if unused:
            lines.append(f"saved variables the model lacks: {unused}")
        if wrong:
            lines.append(f"shapes that differ: {wrong}")
        raise ValueError(
            f"The model {model.name!r} does not match the checkpoint {where}; "
            "restore into a model built the same way (same layers, same "
            "optimizer, trained once or built). " + "; ".join(lines)
        )
    return {
        key: variable
        for key, variable in state.items()
        if key in saved and not (weights_only and key.startswith(skipped))
    }


def load(step_path: str, manifest: dict[str, Any], state: dict[str, Any]) -> None:
    """Every process: give each variable of `state` its saved value, laid out
    the variable's current way; through the writer's engine when it is this
    backend's, else as full arrays read by the writer's engine."""
    wanted = {key: manifest["entries"][key] for key in state}
    writer = manifest["engine"]
    current = engines.engine(current_engine_name())
    try:
        if writer == current_engine_name():
            current.load(step_path, state, wanted)
        else:
            arrays = engines.engine(writer).read_arrays(step_path, wanted)
            current.assign_arrays(state, arrays)
    except damaged.DamagedCheckpointError:
        raise
    except Exception as error:
        if not damaged.is_read_error(error):
            raise
        # The engines name the file where they know it; a library's own error
        # (Orbax's UnicodeDecodeError, torch's UnpicklingError) names none.
        reason = (
            str(error)
            if type(error) is ValueError
            else f"{type(error).__name__}: {error}"
        )
        raise damaged.error_for(step_path, reason) from error


def find_step(directory: str, step: int | None) -> tuple[str, dict[str, Any]]:
    """The step directory to restore (the latest complete one when `step` is
    None) and its manifest; a `ValueError` naming the directory otherwise."""
    directory = os.fspath(directory)
    if step is None:
        latest = store.latest_step(directory)
        if latest is None:
            raise ValueError(
                f"{directory!r} holds no complete keras_dist checkpoint (no "
                "step-<N> directory with its keras_dist.json and every file it "
                "lists). Pass the directory a kd.Checkpoint saved into."
            )
        step = latest
    if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
        raise TypeError(f"`step` must be a step number or None. Received: {step!r}")
    path = store.step_directory(directory, int(step))
    if not os.path.isdir(path):
        raise ValueError(
            f"{directory!r} has no checkpoint of step {step}; its complete steps "
            f"are {store.complete_steps(directory)}."
        )
    try:
        return path, store.read_manifest(path)
    except ValueError as error:
        raise damaged.error_for(path, str(error)) from None
