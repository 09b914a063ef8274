"""Loud failures when a Keras release moves what keras_dist relies on."""

from __future__ import annotations

import keras
import pytest

from keras_dist import _keras_compat


def test_backend_neutral_keras_details_are_where_keras_dist_expects():
    assert _keras_compat.check() == []


@pytest.mark.backend("jax")
def test_jax_trainer_internals_are_where_keras_dist_expects():
    from keras_dist.backends import jax_keras_internals

    missing = jax_keras_internals.check()
    assert missing == [], (
        f"Keras {keras.__version__} moved internals that the JAX adapter relies on: "
        f"{missing}. Update keras_dist/backends/jax_keras_internals.py."
    )


@pytest.mark.backend("torch")
def test_torch_trainer_internals_are_where_keras_dist_expects():
    from keras_dist.backends import torch_keras_internals

    missing = torch_keras_internals.check()
    assert missing == [], (
        f"Keras {keras.__version__} moved internals that the PyTorch adapter relies "
        f"on: {missing}. Update keras_dist/backends/torch_keras_internals.py."
    )
