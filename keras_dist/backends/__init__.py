"""Backend adapters: the only modules that import jax, torch or tensorflow."""

from __future__ import annotations

import functools
import importlib

import keras

from keras_dist.backends.base import BackendAdapter
from keras_dist.common import job
from keras_dist.keras_compat import versions

_ADAPTER_MODULES = {
    "jax": "keras_dist.backends.jax.adapter",
    "torch": "keras_dist.backends.torch.adapter",
    "tensorflow": "keras_dist.backends.tensorflow.adapter",
}


@functools.cache
def get_adapter() -> BackendAdapter:
    """The adapter for the Keras backend of this process (`KERAS_BACKEND`)."""
    backend_name = keras.backend.backend()
    module_name = _ADAPTER_MODULES.get(backend_name)
    if module_name is None:
        raise NotImplementedError(
            "keras_dist supports the Keras backends "
            f"{sorted(_ADAPTER_MODULES)}. Received: backend={backend_name!r}. "
            "Set KERAS_BACKEND to one of them."
        )
    try:
        adapter = importlib.import_module(module_name).ADAPTER
    except ImportError as error:
        if isinstance(error, versions.UnsupportedKerasError) or not (
            error.name or ""
        ).startswith("keras."):
            raise
        # A Keras that moved what this adapter imports: one clear error.
        raise versions.unsupported(
            f"it has no {error.name} (the {backend_name} adapter needs it)"
        ) from error
    # Every layer asks the job's facts for this process' rank (`warn_once`).
    job.set_rank_source(adapter.process_id)
    return adapter


__all__ = ["BackendAdapter", "get_adapter"]
