"""`fit`, `evaluate` and `predict` under keras_dist never return while a step
has failed, whatever `verbose` (`training.session`, `wait_for_steps`).

JAX dispatches steps asynchronously: a step that fails on a device leaves
errors in its outputs, and with `verbose=0` nothing reads them, so plain
Keras' `fit` returns as if it had trained. The steps here cannot be allocated
on any machine: a sort of 2**46 float32 numbers needs 2**48 bytes, more than
a process' address space, so the allocation fails at once and no page is
touched."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import keras_dist as kd
from keras_dist.training import out_of_memory
from keras_dist.training.out_of_memory import OutOfDeviceMemoryError


class Unallocatable(keras.layers.Layer):
    """Passes its inputs on, after a sort no device can hold."""

    def compute_output_shape(self, shape):
        return shape

    def call(self, inputs):
        row = ops.mean(inputs) - ops.arange(2**23, dtype=inputs.dtype)
        wide = ops.broadcast_to(row[None, :], (2**23, 2**23))
        # No gradient through the sort (TensorFlow's would build another).
        return inputs + 0.0 * ops.stop_gradient(ops.sort(wide, axis=1)[0, :1])


class FailsWhenRun(keras.layers.Layer):
    """TensorFlow: a check inside the compiled step that fails when the step
    runs (TensorFlow's allocator waits seconds before it gives up on a
    buffer it cannot allocate)."""

    def compute_output_shape(self, shape):
        return shape

    def call(self, inputs):
        import tensorflow as tf  # noqa: PLC0415 (the TensorFlow run only)

        check = tf.debugging.assert_less(
            tf.reduce_sum(inputs), -1.0, message="the step's own check failed"
        )
        with tf.control_dependencies([check]):
            return tf.identity(inputs)


class Trained(kd.Trainer, keras.Sequential):
    pass


def _model(cls=keras.Sequential, failing=Unallocatable, **kwargs) -> keras.Model:
    model = cls(
        [
            keras.Input((16,)),
            keras.layers.Dense(8),
            failing(),
            keras.layers.Dense(1),
        ],
        **kwargs,
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


X = np.zeros((16, 16), "float32")
Y = np.zeros((16, 1), "float32")


def _two_devices() -> kd.DataParallel:
    """Two devices on JAX and TensorFlow; PyTorch's process is one."""
    return kd.DataParallel(devices=kd.list_devices()[:2])


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begun: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)


@pytest.mark.backend("jax")
@pytest.mark.parametrize("verbose", [0, 2])
def test_fit_raises_the_out_of_memory_error_whatever_verbose(verbose):
    epochs = Epochs()
    callbacks = [kd.DistributeCallback(_two_devices()), epochs]
    with pytest.raises(OutOfDeviceMemoryError) as raised:
        _model().fit(X, Y, batch_size=8, epochs=3, verbose=verbose, callbacks=callbacks)
    assert type(raised.value.__cause__).__name__ == "JaxRuntimeError"
    message = str(raised.value)
    assert "RESOURCE_EXHAUSTED" in message or "Out of memory" in message
    # It says what it could not read, never "unknown".
    assert "limit could not be read (the engine reports none for them" in message
    assert "unknown" not in message
    # At the failed epoch's end, not after every later epoch.
    assert epochs.begun == [0]
    assert keras.distribution.distribution() is None


@pytest.mark.backend("jax")
@pytest.mark.parametrize("verbose", [0, 2])
def test_evaluate_predict_and_the_trainer_raise_whatever_verbose(verbose):
    model = _model()
    for call, data in ((model.evaluate, (X, Y)), (model.predict, (X,))):
        with pytest.raises(OutOfDeviceMemoryError, match=f"^{call.__name__} ran"):
            callback = kd.DistributeCallback(_two_devices())
            call(*data, batch_size=8, verbose=verbose, callbacks=[callback])
    trained = _model(Trained, distribution=_two_devices())
    with pytest.raises(OutOfDeviceMemoryError, match="^fit ran"):
        trained.fit(X, Y, batch_size=8, verbose=verbose)
    assert keras.distribution.distribution() is None


@pytest.mark.backend("jax")
def test_the_message_says_which_memory_it_could_not_read():
    """A device of no known kind (planned devices this host lacks): its
    memory is not read, and the message says why instead of "unknown"."""
    from keras_dist.backends.jax import input_adapter

    # No batch of an earlier call: the account from shapes, as for a call
    # whose batch was not seen.
    input_adapter.forget_last_batch()
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    distribution = kd.DataParallel(devices=["gpu:0", "gpu:1"])
    message = out_of_memory.explain(model, distribution, "fit")
    assert (
        "the device's memory limit could not be read (the device reports "
        "none, and keras_dist has no data sheet for its kind)" in message
    )
    assert "no memory limit to compare with" in message
    assert "unknown" not in message


@pytest.mark.backend("jax")
def test_plain_keras_fit_returns_from_a_failed_step_with_verbose_0():
    """What keras_dist does better (docs/faults.md says so): plain Keras'
    `fit(verbose=0)` returns, and the error waits for the weights' reader."""
    model = _model()
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    with pytest.raises(Exception, match="Out of memory") as raised:
        np.asarray(model.trainable_variables[0].value)
    assert type(raised.value).__name__ == "JaxRuntimeError"


@pytest.mark.backend("jax")
def test_plain_keras_evaluate_returns_from_a_failed_step_with_verbose_0():
    """docs/faults.md says plain Keras' `evaluate` returns too: it hands back
    the metrics' values without reading them."""
    model = _model()
    returned = model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)
    with pytest.raises(Exception, match="Out of memory") as raised:
        float(returned["loss"])
    assert type(raised.value).__name__ == "JaxRuntimeError"


@pytest.mark.backend("torch", "tensorflow")
@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_torch_and_tensorflow_raise_from_the_failed_step(call):
    """Their steps run before the call that dispatched them returns: the
    error of a step that fails when it runs (PyTorch: cannot be allocated)
    reaches the user with `verbose=0` too."""
    tensorflow = keras.backend.backend() == "tensorflow"
    model = _model(failing=FailsWhenRun if tensorflow else Unallocatable)
    arguments = (X,) if call == "predict" else (X, Y)
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the engine's own)
        getattr(model, call)(
            *arguments,
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(_two_devices())],
        )
    if tensorflow:
        assert type(raised.value).__name__ == "InvalidArgumentError"
        assert "own check failed" in str(raised.value)
    else:
        assert "can't allocate memory" in str(raised.value)
