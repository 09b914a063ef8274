"""Loud failures when a Keras release moves what keras_dist relies on."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

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


# -- the Keras releases keras_dist drives (keras_compat.backend, versions) --------
def test_the_backend_modules_and_classes_are_found_on_this_keras():
    from keras.src.trainers.epoch_iterator import EpochIterator

    from keras_dist.keras_compat import backend

    name = keras.backend.backend()
    assert callable(backend.ops_module(name).convert_to_tensor)
    assert backend.trainer_class(name) in type(keras.Model()).__mro__
    assert issubclass(backend.epoch_iterator_class(name), EpochIterator)
    assert isinstance(keras.Variable(0.0), backend.variable_class(name))
    assert backend.check() == []


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.backend_neutral  # keras_dist's own import, before any backend
def test_a_keras_older_than_the_supported_range_is_one_clear_error():
    done = _run(
        """
        import keras
        keras.__version__ = "3.14.2"
        try:
            import keras_dist as kd  # with KERAS_DIST_CPU_DEVICES: here
            kd.DataParallel  # else: at the first use
        except ImportError as error:
            print(type(error).__name__, "|", error)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("UnsupportedKerasError |"), line
    assert "Keras 3.14.2" in line and "needs Keras 3.15 or newer" in line
    assert "keras>=3.15,<3.17" in line


@pytest.mark.backend("jax", "torch")
def test_a_keras_that_moved_what_an_adapter_imports_is_one_clear_error():
    # As if a release moved the backend's op modules again. (The TensorFlow
    # adapter imports none of them: its trainer and epoch iterator classes
    # are found from `keras.Model`, as the test above checks.)
    done = _run(
        """
        import sys
        import keras
        backend = keras.backend.backend()
        for name in (f"keras.src.backend.{backend}.ops.core",
                     f"keras.src.backend.{backend}.core"):
            sys.modules[name] = None
        try:
            import keras_dist as kd
            kd.list_devices()
        except ImportError as error:
            print(type(error).__name__, "|", error)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("UnsupportedKerasError |"), line
    assert f"Keras {keras.__version__}" in line and "has no module 'core'" in line
    assert "keras>=3.15,<3.17" in line


@pytest.mark.backend_neutral  # keras_dist's lazy API, before any backend
def test_plain_keras_keeps_working_when_keras_dist_cannot_load(monkeypatch):
    # keras_dist imported first, Keras after it: keras_dist's API loads right
    # after Keras. When that fails, `import keras` still works and the first use
    # of keras_dist's API raises the failure.
    monkeypatch.delenv("KERAS_DIST_CPU_DEVICES", raising=False)
    done = _run(
        """
        import sys
        sys.modules["keras_dist.planner"] = None  # a module that cannot load
        import keras_dist as kd
        import keras
        print(keras.ops.convert_to_numpy(keras.ops.ones((2,))).tolist())
        try:
            kd.DataParallel
        except ImportError as error:
            print(type(error).__name__, error.name)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == [
        "[1.0, 1.0]",
        "ModuleNotFoundError keras_dist.planner",
    ]


def test_the_supported_range_is_the_one_pyproject_asks_for():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from keras_dist.keras_compat import versions

    root = pathlib.Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    assert f"keras{versions.SUPPORTED_RANGE}" in dependencies
    assert versions.keras_version() >= versions.MINIMUM
