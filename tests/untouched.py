"""What a call keras_dist refuses must leave as it was, checked by the tests
of each refusal: the model's and its optimizer's values, Keras' global
distribution, the flash-attention setting, the instance attributes keras_dist
sets on the model, its layers and its optimizer for a call, every function of
the Keras modules and classes keras_dist patches, and no run left active."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import keras
import numpy as np

from keras_dist.keras_compat import backend as keras_backends
from keras_dist.keras_compat.layers import layers_of
from keras_dist.training import session

# What keras_dist sets on a model, a layer or an optimizer for one call.
_OWN = {
    "model": (
        "train_step",
        "test_step",
        "predict_step",
        "make_predict_function",
        "_purge_model_variables",
    ),
    "layer": ("call", "_flash_attention"),
    "optimizer": (
        "add_variable",
        "add_variable_from_reference",
        "_backend_update_step",
    ),
}


# Fixes TensorFlow's adapter installs once for the process at its first
# distributed call, for good (`install_multi_worker_fixes`,
# `install_scalar_reads`: Keras' own behaviour outside keras_dist's strategies).
_FOR_THE_PROCESS = {
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica"),
    ("TensorFlowTrainer", "_maybe_symbolic_build"),
    ("Trainer", "_maybe_symbolic_build"),
    ("Variable", "__int__"),
    ("Variable", "__float__"),
}


def _keras_functions() -> dict[tuple[str, str], int]:
    """The identity of every attribute of the Keras modules and classes
    keras_dist may patch during a call."""
    backend = keras.backend.backend()
    owners: list[Any] = [
        keras_backends.trainer_module(backend),
        keras_backends.ops_module(backend),
        keras_backends.ops_module(backend, "nn"),
        keras.Model,
        keras_backends.trainer_class(backend),
        keras_backends.epoch_iterator_class(backend),
        keras_backends.variable_class(backend),
        keras.layers.Layer,
        keras.layers.MultiHeadAttention,
        keras.optimizers.Optimizer,
        keras.metrics.Metric,
    ]
    for name in (
        f"keras.src.backend.{backend}.distribution_lib",
        "keras.src.distribution.distribution_lib",
    ):
        try:
            owners.append(importlib.import_module(name))
        except ImportError:
            continue
    found = {}
    for owner in owners:
        for name, value in vars(owner).items():
            if callable(value) or inspect.isfunction(value):
                found[(getattr(owner, "__name__", repr(owner)), name)] = id(value)
    return found


def _values(variables: list) -> dict[str, np.ndarray]:
    return {v.path: np.array(v) for v in variables}


class Untouched:
    """Everything a refused call must leave as it was, taken before it."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.weights = [np.array(w) for w in model.get_weights()]
        self.optimizer = model.optimizer
        self.slots = _values(self.optimizer.variables) if self.optimizer else {}
        self.distribution = keras.distribution.distribution()
        self.flash = keras.config.is_flash_attention_enabled()
        self.own = self._own()
        self.functions = _keras_functions()

    def _own(self) -> dict:
        own = {}
        for kind, owner in [
            ("model", self.model),
            ("optimizer", self.optimizer),
            *[("layer", layer) for layer in layers_of(self.model)],
        ]:
            if owner is None:
                continue
            for name in _OWN[kind]:
                own[(id(owner), name)] = id(vars(owner).get(name))
        return own

    def check(self) -> None:
        """Assert that nothing changed (the model's values readable)."""
        assert session._active_runs == {}
        assert keras.distribution.distribution() is self.distribution
        assert keras.config.is_flash_attention_enabled() == self.flash
        assert self.model.optimizer is self.optimizer
        for got, want in zip(self.model.get_weights(), self.weights, strict=True):
            np.testing.assert_array_equal(got, want)
        if self.optimizer is not None:
            values = _values(self.optimizer.variables)  # made during it: new
            for path, want in self.slots.items():
                np.testing.assert_array_equal(values[path], want)
                assert values[path].dtype == want.dtype, path
        assert self._own() == self.own
        changed = {
            key
            for key, value in _keras_functions().items()
            if self.functions.get(key) != value
            and not (
                keras.backend.backend() == "tensorflow" and key in _FOR_THE_PROCESS
            )
        }
        assert not changed, f"patched and left: {sorted(changed)}"
