"""JAX layouts that do not fit their variable, and model-parallel saves.

- A layout splitting a dimension into unequal parts (Dense(10) laid out
  `(None, "model")` over 4 devices) is refused before anything moves, naming
  the variable, the dimension and the mesh axis; the model stays as it was, so
  a plain Keras `fit` afterwards trains like a never-touched model.
- Two real processes (2 CPU devices each) train a model whose kernels are
  split across the processes; `get_weights`, `save_weights`, `model.save`,
  `ModelCheckpoint` and `load_weights` work, and the files hold the weights of
  the same training run in one process on 4 devices and load in plain Keras.
"""

from __future__ import annotations

import concurrent.futures
import json

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job
from tests.untouched import Untouched

pytestmark = pytest.mark.backend("jax")


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    return x, rng.normal(size=(16, 10)).astype("float32")


def _net() -> keras.Model:
    keras.utils.set_random_seed(1)
    net = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(4, name="narrow"),
            keras.layers.Dense(10, name="wide"),
        ],
        name="net",
    )
    net.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return net


def _fit(net: keras.Model, *callbacks) -> list[np.ndarray]:
    x, y = _data()
    net.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return net.get_weights()


def test_a_layout_that_does_not_divide_names_the_variable_and_leaves_the_model():
    mesh = kd.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = kd.LayoutMap(mesh)
    layout_map["wide/kernel"] = (None, "model")  # 10 columns over 4 devices
    distribution = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    net = _net()
    before = net.get_weights()
    untouched = Untouched(net)
    with pytest.raises(ValueError) as raised:
        _fit(net, kd.DistributeCallback(distribution))
    untouched.check()
    message = str(raised.value)
    assert "'net/wide/kernel' of shape (4, 10)" in message
    assert "dimension 1 has size 10" in message
    assert "mesh axis 'model' (4 devices)" in message
    assert "multiple of 4 (e.g. 12)" in message
    assert keras.distribution.distribution() is None
    for ours, theirs in zip(net.get_weights(), before, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    # Everyday Keras still works on the same model, like on an untouched one.
    trained = _fit(net)
    for ours, theirs in zip(trained, _fit(_net()), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    # The corrected layout (4 columns over 4 devices) trains it.
    layout_map = kd.LayoutMap(mesh)
    layout_map["narrow/kernel"] = (None, "model")
    corrected = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    assert all(
        np.isfinite(w).all() for w in _fit(net, kd.DistributeCallback(corrected))
    )


def test_model_parallel_saves_across_processes_equal_one_process(tmp_path):
    """Kernels split over 2 processes: every save worked and equals 1 process."""

    def job(processes: int, devices: str, name: str) -> list[dict]:
        return run_job(
            "model_parallel_saving_worker.py",
            [str(tmp_path / name)],
            processes=processes,
            env={"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": devices},
            output_dir=tmp_path / f"logs-{name}",
            timeout=180,
        )

    # Both jobs at once (each waits on its own processes).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        two_job = pool.submit(job, 2, "2", "two")
        (one,) = job(1, "4", "one")
        two = two_job.result()
    reference = [np.asarray(w) for w in one["weights"]]
    for result in two:
        assert result["devices"] == 4
        assert result["loaded_back_error"] < 1e-6
        assert result["still_split"]  # load_weights kept the kernel split
        for ours, theirs in zip(result["weights"], reference, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    files = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert files == ["ckpt.keras", "ckpt.weights.h5", "m.keras", "w.weights.h5"]
    # The files load in plain Keras (this process: one device, no keras_dist).
    for name in ("m.keras", "ckpt.keras"):
        loaded = keras.saving.load_model(tmp_path / "two" / name)
        for ours, theirs in zip(loaded.get_weights(), reference, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    for name in ("w.weights.h5", "ckpt.weights.h5"):
        plain = _worker_net()
        plain.load_weights(tmp_path / "two" / name)
        for ours, theirs in zip(plain.get_weights(), reference, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert json.dumps(two[0]["weights"]) == json.dumps(two[1]["weights"])


def _worker_net() -> keras.Model:
    from tests.workers.model_parallel_saving_worker import build  # noqa: PLC0415

    return build()
