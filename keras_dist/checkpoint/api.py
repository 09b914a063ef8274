"""`kd.restore` and `kd.export`."""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_dist.checkpoint import damaged, store
from keras_dist.checkpoint import state as checkpoint_state
from keras_dist.runtime.join_check import require_joined
from keras_dist.training import saving


def restore(
    model: Any,
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    on_damaged: str = "warn",
) -> int:
    """Load a `kd.Checkpoint` checkpoint into `model`, laid out the way the
    active distribution lays it out, whatever mesh, device count, process
    count or backend wrote it.

    Every process calls it. The model must be built; an optimizer it has but
    never built is built first. Metric states are loaded into a model whose
    metrics are built (one that trained), else left out. A checkpoint written
    on another backend is read whole by the writer's engine (its library must
    be installed here) and then laid out: each process then holds the full
    model in memory for a moment.

    Args:
        model: a built Keras model, the same architecture as the saved one.
        directory: the directory the `kd.Checkpoint` saved into.
        step: which step to load; None: the newest one that reads.
        on_damaged: with `step=None`, when the newest checkpoints are
            damaged (a file cut short or altered): `"warn"` loads the newest
            one that reads, warning with the damaged step, its file and the
            reason; `"raise"` raises that `DamagedCheckpointError`. A given
            `step` that is damaged always raises it.

    Returns:
        The step that was loaded.

    Example:

    ```python
    model = make_model()
    model.build((None, 784))
    step = kd.restore(model, "checkpoints")
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kd.restore needs a keras.Model. Received: {model!r} of type "
            f"{type(model).__name__}"
        )
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            "`directory` must be the directory a kd.Checkpoint saved into. "
            f"Received: directory={directory!r} of type {type(directory).__name__}"
        )
    damaged.check_on_damaged(on_damaged)
    # As kd.Checkpoint: Orbax (JAX) reads absolute paths only.
    directory = store.local_directory(directory, "kd.restore")
    if step is not None:
        return _restore_step(model, directory, step)
    restored = damaged.restore_newest(
        directory,
        lambda step: _restore_step(model, directory, step),
        on_damaged=on_damaged,
        what="kd.restore",
        taking="restoring",
        without="nothing is restored",
    )
    if restored is None:
        steps, broken = store.scan(directory)
        if not steps and not broken:
            checkpoint_state.find_step(directory, None)  # "holds no checkpoint"
        raise ValueError(
            f"kd.restore: no checkpoint of {directory!r} reads: steps "
            f"{sorted({*steps, *broken})} are all damaged (the warning above says "
            "how). Pass the directory of an intact kd.Checkpoint."
        )
    return restored


def _restore_step(model: Any, directory: str, step: int) -> int:
    path, manifest = checkpoint_state.find_step(directory, step)
    state = checkpoint_state.match(
        model, manifest, path, weights_only=bool(manifest.get("weights_only"))
    )
    checkpoint_state.load(path, manifest, state)
    return int(manifest["step"])


def export(model: Any, path: str | os.PathLike, *, overwrite: bool = True) -> str:
    """Write `model` as one plain Keras file (`.keras`: architecture, weights
    and optimizer; `.weights.h5`: weights) that plain Keras loads on any
    backend, however the model is laid out.

    Call it on every process (reading a variable split across processes is
    collective): process 0 writes, to a temporary name renamed once complete,
    so the file is never corrupt; every process returns once it is there.

    Example:

    ```python
    kd.export(model, "model.keras")  # then: keras.saving.load_model("model.keras")
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kd.export needs a keras.Model. Received: {model!r} of type "
            f"{type(model).__name__}"
        )
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"`path` must be a file path. Received: {path!r}")
    path = os.fspath(path)
    if not path.endswith((".keras", ".weights.h5")):
        raise ValueError(
            "kd.export writes a `.keras` file (the whole model) or a "
            f"`.weights.h5` file (the weights). Received: {path!r}"
        )
    require_joined("`kd.export`")  # else every process writes `path`
    saving.install()
    if path.endswith(".weights.h5"):
        model.save_weights(path, overwrite=overwrite)
    else:
        model.save(path, overwrite=overwrite)
    return path
