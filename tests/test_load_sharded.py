"""Loading weights into a sharded model never puts a whole variable on one
device (issue 14; keras#21712: Keras' `assign` copies the whole value onto one
device before laying it out).

What a device receives is measured, not assumed: `sys.setprofile` (and
`threading.setprofile`, for Orbax's threads) sees every array that a Python
function returns while loading, the arrays JAX creates (`jnp.asarray`,
`device_put`, `make_array_from_callback`...) included; for each, the bytes it
holds on each device are its shard shape under its sharding (CPU devices
report no `memory_stats()`). The largest of these is the peak one buffer
reaches on a device during the load. JAX on 8 simulated devices here; PyTorch
in a 2-process job (`workers/load_sharded_worker.py`), where the variables are
DTensors while a `fit` runs.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job
from tests.workers.load_sharded_models import wide_model

KERNEL_BYTES = 16 * 2048 * 4  # the "wide" kernel, float32


@contextlib.contextmanager
def _largest_jax_buffers():
    """Yield {device id: bytes of the largest buffer that any array returned
    by a Python function held on that device} for the enclosed code."""
    import jax  # noqa: PLC0415

    largest: dict[int, int] = {}

    def profile(frame, event, value):
        if (
            event == "return"
            and isinstance(value, jax.Array)
            and not isinstance(value, jax.core.Tracer)
        ):
            sharding = value.sharding
            held = math.prod(sharding.shard_shape(value.shape)) * value.dtype.itemsize
            for device in sharding.addressable_devices:
                largest[device.id] = max(largest.get(device.id, 0), held)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield largest
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def _saved_weights(tmp_path) -> tuple[str, list[np.ndarray]]:
    keras.utils.set_random_seed(1)
    source = wide_model()
    path = str(tmp_path / "wide.weights.h5")
    source.save_weights(path)
    return path, source.get_weights()


def _assert_loaded(model, expected) -> None:
    for loaded, saved in zip(model.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(loaded, saved)


def _model_parallel() -> kd.ModelParallel:
    layout_map = kd.LayoutMap(kd.DeviceMesh((8,), ["model"]))
    layout_map["wide/kernel"] = (None, "model")
    return kd.ModelParallel(layout_map=layout_map)


@pytest.mark.backend("jax")
def test_load_weights_in_a_scope_puts_one_eighth_of_the_kernel_on_each_device(
    tmp_path,
):
    path, saved = _saved_weights(tmp_path)
    with _model_parallel().scope():
        model = wide_model()
        with _largest_jax_buffers() as largest:
            model.load_weights(path)
        kernel = model.get_layer("wide").kernel
        # What Keras does on its own (`assign` of a value on one device): the
        # measurement sees the whole kernel land on one device.
        with _largest_jax_buffers() as staged:
            kernel.assign(keras.ops.convert_to_tensor(saved[0]))
        with pytest.raises(ValueError, match="shape of the target variable"):
            kernel.assign(np.zeros((2, 2), "float32"))
    assert max(staged.values()) == KERNEL_BYTES
    assert len(largest) == 8
    assert max(largest.values()) * 8 == KERNEL_BYTES, largest
    assert tuple(kernel.value.sharding.spec) == (None, "model")
    _assert_loaded(model, saved)


@pytest.mark.backend("jax")
# The file holds no optimizer state (its model never trained): Keras says so.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
def test_load_weights_after_an_fsdp_fit_puts_one_eighth_on_each_device(tmp_path):
    path, saved = _saved_weights(tmp_path)
    keras.utils.set_random_seed(2)
    model = wide_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 1), "float32")
    model.fit(
        x, y, batch_size=8, verbose=0, callbacks=[kd.DistributeCallback(kd.FSDP())]
    )
    with _largest_jax_buffers() as largest:
        model.load_weights(path)
    kernel = model.get_layer("wide").kernel
    assert tuple(kernel.value.sharding.spec) == (None, "batch")
    assert len(largest) == 8
    assert max(largest.values()) * 8 == KERNEL_BYTES, largest
    _assert_loaded(model, saved)


@pytest.mark.backend("jax")
def test_kd_restore_reads_each_device_part_from_the_checkpoint(tmp_path):
    """Orbax restores onto the variables' shardings, shard by shard."""
    keras.utils.set_random_seed(1)
    source = wide_model()
    source.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 1), "float32")
    source.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[kd.Checkpoint(tmp_path, save_on_background=False)],
    )
    with _model_parallel().scope():
        model = wide_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with _largest_jax_buffers() as largest:
            kd.restore(model, tmp_path)
    assert len(largest) == 8
    assert max(largest.values()) * 8 == KERNEL_BYTES, largest
    _assert_loaded(model, source.get_weights())


@pytest.mark.backend("jax")
def test_a_keras_hub_preset_loads_each_device_part(tmp_path):
    """KerasHub's `from_preset` builds the backbone, then `load_weights` its
    `model.weights.h5`: that load is measured (building initialises small
    variables on one device first, as Keras does below 250 MiB x devices)."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(3)
    source = keras_hub.models.GemmaBackbone(
        vocabulary_size=512,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=32,
        name="gemma",
    )
    preset = tmp_path / "preset"
    source.save_to_preset(str(preset))
    with kd.FSDP().scope():
        backbone = keras_hub.models.Backbone.from_preset(
            str(preset), load_weights=False
        )
        with _largest_jax_buffers() as largest:
            backbone.load_weights(str(preset / "model.weights.h5"))
    embeddings = backbone.get_layer("token_embedding").embeddings
    assert embeddings.value.sharding.spec[0] == "batch"
    embedding_bytes = 512 * 64 * 4
    assert len(largest) == 8
    assert max(largest.values()) * 8 == embedding_bytes, largest
    _assert_loaded(backbone, source.get_weights())


@pytest.mark.backend("torch")
def test_load_weights_in_a_torch_fit_moves_only_each_process_part(tmp_path):
    """Two processes split the kernel in halves: while loading, no process
    holds a tensor larger than its half (on a CPU the host is the device, so
    this is the largest tensor each process made; on a GPU, the largest it
    moved there)."""
    path, saved = _saved_weights(tmp_path)
    results = run_job(
        "load_sharded_worker.py",
        [path],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path / "job",
    )
    for result in results:
        assert result["kernel_placements"] == ["R", "S(1)"]
        assert result["kernel_local_shape"] == [16, 1024]
        assert result["kernel_bytes"] == KERNEL_BYTES
        assert result["largest_tensor_bytes"] * 2 == KERNEL_BYTES, result
        assert result["wrong_shape"].startswith("ValueError: The shape of the target")
        for loaded, expected in zip(result["loaded"], saved, strict=True):
            np.testing.assert_array_equal(np.asarray(loaded, "float32"), expected)
