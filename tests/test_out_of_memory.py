"""A distributed call that runs out of device memory ends with a plan
(`keras_dist.training.out_of_memory`, `keras_dist.planner.on_devices`). The
engines' out-of-memory errors need an accelerator
(`benchmarks/out_of_memory_check.py` shows one on a TPU chip); here the
engine's words are raised from inside the call (a layer while the step is
traced, or a callback once the first step ran), as the engine would."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.planner import on_devices
from keras_dist.training.out_of_memory import OutOfDeviceMemoryError
from tests.untouched import Untouched

BACKEND = keras.backend.backend()


class Exhausting(keras.layers.Layer):
    """Raises what the engine raises when a buffer does not fit (or another
    error), from inside the train step."""

    def __init__(self, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def call(self, inputs, training=None):
        if training and self.message:
            raise RuntimeError(self.message)
        return inputs


class ExhaustedAfterStep(keras.callbacks.Callback):
    """The engine's words after the first step ran (its batch was laid out)."""

    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError(OOM)


def _model(message: str | None) -> keras.Model:
    layers = [keras.Input((16,)), keras.layers.Dense(256, name="wide")]
    if message is not None:
        layers.append(Exhausting(message, name="exhausting"))
    layers.append(keras.layers.Dense(4, name="out"))
    model = keras.Sequential(layers)
    model.compile(optimizer="adam", loss="mse")
    return model


def _fit(model: keras.Model, callbacks: list, rows: int = 8) -> None:
    x = np.zeros((rows, 16), "float32")
    y = np.zeros((rows, 4), "float32")
    model.fit(x, y, batch_size=rows, epochs=1, verbose=0, callbacks=callbacks)


OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes."


def test_an_out_of_memory_error_names_the_largest_variables_and_what_would_fit():
    model = _model(OOM)
    before = Untouched(model)
    distribution = kd.DataParallel()
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(model, [kd.DistributeCallback(distribution)])
    # Raised in the first step: the model, Keras and keras_dist as they were.
    before.check()
    message = str(raised.value)
    assert message.startswith("fit ran out of device memory under")
    assert "wide/kernel (16, 256)" in message, message  # the largest first
    if BACKEND == "jax":
        # Compiled again for these devices: the layer raises there too, and
        # the allocation XLA's words name is what was needed at least.
        assert "could not allocate a buffer of 4.00 GiB" in message, message
        assert "XLA needs 4.00 GiB a device for the whole step" in message
        assert "kd.FSDP() on the same devices" in message
        assert 'remat="full"' in message
    else:
        assert "From shapes only" in message
        assert "gradients at most" in message and "optimizer slots" in message
        if np.asarray(distribution.device_mesh.devices).size > 1:
            for candidate in ("kd.DataParallel()", "kd.FSDP()"):
                assert candidate in message
        else:  # FSDP cannot help one device: never offered there
            assert "One device: FSDP cannot split anything on it" in message
            assert "kd.FSDP()" not in message
    assert "keras_dist.plan_search" in message
    assert OOM in message and isinstance(raised.value.__cause__, RuntimeError)
    # The run ended with the call: the model trains again afterwards, in
    # plain Keras and under the distribution (the engine's memory found).
    model.get_layer("exhausting").message = None
    _fit(model, [])
    _fit(model, [kd.DistributeCallback(distribution)])


def test_other_errors_and_plain_keras_are_left_as_they_are():
    with pytest.raises(RuntimeError, match="something else"):
        _fit(_model("something else"), [kd.DistributeCallback(kd.DataParallel())])
    # Without keras_dist's callback the engine's error reaches the user as is.
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as raised:
        _fit(_model(OOM), [])
    assert not isinstance(raised.value, OutOfDeviceMemoryError)


@pytest.mark.backend("jax")
def test_the_failed_step_is_compiled_for_its_devices_with_xlas_figures():
    model = _model(None)
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(
            model, [kd.DistributeCallback(kd.DataParallel()), ExhaustedAfterStep()], 64
        )
    message = str(raised.value)
    assert "at a global batch of 64" in message
    # CPU devices report no limit, and the engine's words name none.
    assert "the devices' limit could not be read" in message, message
    assert "XLA's memory analysis of the train step" in message
    assert "temporaries" in message and "wide/kernel" in message
    assert "batch 32 (half): XLA needs" in message
    assert "kd.FSDP() on the same devices: XLA needs" in message
    assert 'remat="full": XLA needs' in message
    assert "at most 4 compiles and 60 s" in message
    assert "unknown" not in message
    # Trains again afterwards, its own steps back.
    _fit(model, [kd.DistributeCallback(kd.DataParallel())], 64)


@pytest.mark.backend("jax")
def test_a_device_limit_gives_the_shortfall_and_the_largest_batch(monkeypatch):
    seen = {}
    compile_once = on_devices._Compiler.__call__

    def recording(self, distribution, batch):
        figures = compile_once(self, distribution, batch)
        seen.setdefault("peaks", []).append(figures.get("peak_bytes"))
        return figures

    monkeypatch.setattr(on_devices._Compiler, "__call__", recording)
    # A limit between the half batch's peak and the whole one's.
    monkeypatch.setattr(on_devices, "device_limit", lambda distribution: LIMIT[0])
    LIMIT = [None]
    model = _model(None)
    callbacks = [kd.DistributeCallback(kd.DataParallel()), ExhaustedAfterStep()]
    with pytest.raises(OutOfDeviceMemoryError):
        _fit(model, callbacks, 64)
    whole, half = seen["peaks"][:2]
    assert half < whole
    LIMIT[0] = (whole + half) // 2
    seen.clear()
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(_model(None), callbacks, 64)
    message = str(raised.value)
    assert "short)" in message and "batch 32 (half): fits" in message, message
    largest = int(message.split("the largest batch that fits: about ")[1].split()[0])
    assert 32 <= largest < 64 and largest % 8 == 0
    assert len(seen["peaks"]) <= on_devices.MAX_COMPILES


@pytest.mark.backend("jax")
def test_one_device_is_not_offered_fsdp_and_the_budget_is_said(monkeypatch):
    monkeypatch.setattr(on_devices, "MAX_COMPILES", 2)
    monkeypatch.setattr(on_devices, "device_limit", lambda distribution: 2**16)
    import jax  # noqa: PLC0415

    one = kd.DataParallel(devices=[f"cpu:{jax.devices()[0].id}"])
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(_model(None), [kd.DistributeCallback(one), ExhaustedAfterStep()], 16)
    message = str(raised.value)
    assert "kd.FSDP() on the same devices" not in message
    assert "FSDP would need at least" in message and "this job has 1" in message
    assert "not compiled (2 compiles in" in message and 'remat="full"' in message


@pytest.mark.backend("jax")
def test_a_failed_compile_falls_back_to_the_static_plan(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(on_devices, "explain", broken)
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _fit(_model(OOM), [kd.DistributeCallback(kd.DataParallel())])
    message = str(raised.value)
    assert "From shapes only: compiling the step again failed" in message
    assert "no compiler here" in message and "wide/kernel" in message


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "text, needed, available",
    [
        (
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
            "memory in memory space hbm. Used 15.80G of 15.75G hbm. Exceeded "
            "hbm capacity by 52.07M.",
            int(15.80 * 2**30),
            int(15.75 * 2**30),
        ),
        ("15.80G needed, 15.75G available", int(15.80 * 2**30), int(15.75 * 2**30)),
        (
            "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to "
            "allocate 4.00G. That was not possible. There are 2.31G free.",
            4 * 2**30,
            int(2.31 * 2**30),
        ),
        (OOM, 4 * 2**30, None),
        ("CUDA out of memory.", None, None),
    ],
)
def test_the_engines_words_give_the_shortfall(text, needed, available):
    assert on_devices.shortfall_in(text) == (needed, available)


@pytest.mark.backend_neutral
def test_the_static_account_says_how_many_devices_fsdp_would_need():
    from keras_dist.training import out_of_memory  # noqa: PLC0415

    said = out_of_memory._more_devices(state=5 * 2**30, memory=2**30)
    assert "it would need at least 8 devices to hold this state" in said
    assert "could not be said" in out_of_memory._more_devices(2**30, None)


@pytest.mark.backend_neutral
def test_a_missing_figure_is_named_not_called_unknown():
    no_limit = on_devices._fsdp_chips(2**30, None, 2)
    assert "the devices' memory limit could not be read" in no_limit
    assert "XLA gave no peak" not in no_limit
    no_peak = on_devices._fsdp_chips(None, 2**30, 2)
    assert "XLA gave no peak for the step" in no_peak
    assert on_devices.gib(None) == "(not in XLA's memory analysis)"
    for said in (no_limit, no_peak, on_devices.gib(None)):
        assert "unknown" not in said and "not known" not in said
    assert "16 devices" in on_devices._fsdp_chips(5 * 2**30, 2**30, 2)


class _CudaExhausting(keras.layers.Layer):
    """Raises torch's own CUDA out-of-memory error from inside the step, as a
    GPU's allocator does (the class exists in torch's CPU builds too)."""

    def call(self, inputs, training=None):
        import torch  # noqa: PLC0415

        if training:
            raise torch.cuda.OutOfMemoryError(
                "CUDA error: allocation of 2.00 GiB failed; GPU 0 has a total "
                "capacity of 79.10 GiB of which 1.02 GiB is free."
            )
        return inputs


@pytest.mark.backend("torch")
def test_torchs_cuda_out_of_memory_error_becomes_the_plan():
    # The words are not CUDA's usual "out of memory": the type alone says it.
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(256, name="wide"), _CudaExhausting()]
    )
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        model.fit(
            np.zeros((8, 16), "float32"),
            np.zeros((8, 256), "float32"),
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(kd.DataParallel())],
        )
    assert str(raised.value).startswith("fit ran out of device memory under")
    assert "wide/kernel (16, 256)" in str(raised.value)
    assert type(raised.value.__cause__).__name__ == "OutOfMemoryError"
