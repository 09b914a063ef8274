"""The checkpoint engines: one trusted library per backend, one interface.

Each backend writes its checkpoints with the library its users already use:
Orbax on JAX, `torch.distributed.checkpoint` on PyTorch, `tf.train.Checkpoint`
on TensorFlow. keras_dist adds what none of them does across backends: the
keys (Keras' own structural paths, `keras_dist.checkpoint.state`), the atomic
step directories and the manifest (`keras_dist.checkpoint.store`), the
training position, and reading one engine's checkpoint on another backend.

An engine is a module `keras_dist.backends.<backend>.checkpoint` with:

`ENGINE: str`
    its name, recorded in every manifest.

`save(directory, state, *, background) -> Pending`
    Every process calls it, with the same keys. `state` maps keys to Keras
    variables laid out by the active distribution (or plain ones). Writes
    their values into `directory` (it exists, it is empty, every process sees
    it), each process only the shards it owns (a replicated value is written
    once). Returns once the values are captured: training may change the
    variables right after. With `background=False` the files are complete when
    it returns; with `background=True` writing goes on in the background.

`Pending.wait(timeout_seconds) -> None`
    Blocks until this process' part of the save is on disk, and, on process 0,
    until the whole checkpoint is (the engine's own completion on every
    process). Raises `RuntimeError` naming the rank on failure or timeout.
    `Pending.done() -> bool` says whether `wait` would return at once.

`load(directory, state, entries) -> None`
    Every process calls it: each variable of `state` gets the saved value of
    its key, laid out the variable's current way, whatever mesh, device count
    or process count wrote it; each process reads only what it needs.
    `entries[key]` is the manifest's `{"shape": [...], "dtype": "float32"}`.

`read_arrays(directory, entries) -> dict[str, numpy.ndarray]`
    One process, no process group, whatever Keras backend runs: the full
    value of every key in `entries`. Imports only the engine's library.

`assign_arrays(state, arrays) -> None`
    Every process, the same full arrays: each variable of `state` gets
    `arrays[key]`, laid out the variable's current way (a restore from
    another backend's engine).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Engine name -> its module, and the engine each Keras backend writes with.
ENGINES = {
    "orbax": "keras_dist.backends.jax.checkpoint",
    "torch.distributed.checkpoint": "keras_dist.backends.torch.checkpoint",
    "tf.train.Checkpoint": "keras_dist.backends.tensorflow.checkpoint",
}
BACKEND_ENGINES = {
    "jax": "orbax",
    "torch": "torch.distributed.checkpoint",
    "tensorflow": "tf.train.Checkpoint",
}
_EXTRAS = {
    "orbax": "jax",
    "torch.distributed.checkpoint": "torch",
    "tf.train.Checkpoint": "tensorflow",
}


def engine(name: str) -> ModuleType:
    """The engine module called `name`; a clear error when its library is
    not installed."""
    if name not in ENGINES:
        raise ValueError(
            f"Unknown checkpoint engine {name!r}; keras_dist writes with one of "
            f"{sorted(ENGINES)}. Was this checkpoint written by a newer keras_dist?"
        )
    try:
        return importlib.import_module(ENGINES[name])
    except ImportError as error:
        raise ImportError(
            f"This checkpoint was written with {name}, which is not installed "
            f"here ({error}). Install it with `pip install "
            f"keras-dist[{_EXTRAS[name]}]`, or convert the checkpoint where it is "
            "installed: `keras-dist checkpoint convert`."
        ) from error


def backend_engine(backend: str) -> str:
    """The name of the engine a Keras backend writes with."""
    if backend not in BACKEND_ENGINES:
        raise ValueError(
            f"keras_dist checkpoints support the Keras backends "
            f"{sorted(BACKEND_ENGINES)}; received backend {backend!r}."
        )
    return BACKEND_ENGINES[backend]
