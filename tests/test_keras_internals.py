"""Loud failures when a Keras release moves what keras_dist relies on."""

from __future__ import annotations

import keras
import pytest

from keras_dist import keras_compat


def test_backend_neutral_keras_details_are_where_keras_dist_expects():
    assert keras_compat.check() == []


@pytest.mark.backend("jax")
def test_jax_trainer_internals_are_where_keras_dist_expects():
    from keras_dist.backends.jax import keras_internals as jax_keras_internals

    missing = jax_keras_internals.check()
    assert missing == [], (
        f"Keras {keras.__version__} moved internals that the JAX adapter relies on: "
        f"{missing}. Update keras_dist/backends/jax/keras_internals.py."
    )


@pytest.mark.backend("torch")
def test_torch_trainer_internals_are_where_keras_dist_expects():
    from keras_dist.backends.torch import keras_internals as torch_keras_internals

    missing = torch_keras_internals.check()
    assert missing == [], (
        f"Keras {keras.__version__} moved internals that the PyTorch adapter relies "
        f"on: {missing}. Update keras_dist/backends/torch/keras_internals.py."
    )


@pytest.mark.backend("torch")
def test_keras_hands_a_torch_data_loader_to_the_torch_adapter_as_is():
    import numpy as np
    import torch
    from keras.src.trainers.data_adapters import get_data_adapter

    from keras_dist.backends.torch import keras_internals as torch_keras_internals

    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    assert torch_keras_internals.data_loader_of(get_data_adapter(loader)) is loader, (
        f"Keras {keras.__version__} no longer wraps a DataLoader in "
        "TorchDataLoaderAdapter; update data_loader_of in "
        "backends/torch/keras_internals.py."
    )
    arrays = get_data_adapter(np.zeros((4, 1)), batch_size=2)
    assert torch_keras_internals.data_loader_of(arrays) is None


@pytest.mark.backend("tensorflow")
def test_tensorflow_trainer_internals_are_where_keras_dist_expects():
    from keras_dist.backends.tensorflow import keras_internals as tf_keras_internals

    missing = tf_keras_internals.check()
    assert missing == [], (
        f"Keras {keras.__version__} moved internals that the TensorFlow adapter "
        f"relies on: {missing}. Update "
        "keras_dist/backends/tensorflow/keras_internals.py."
    )
