"""A script that trains and ends, as a user's would: `tests/clean_exit.py`
runs it and checks that the process ends with 0 and nothing aborts.

Used features, each of which makes objects for a call (strategies, steps,
iterators, writer threads): `kd.Checkpoint`, a Dropout layer (a seed
generator), reading the weights, `evaluate` and `predict` after `fit`, a
second `fit` of the same model, a `kd.Trainer` model in mixed precision,
and on JAX the optimizer state offloaded to host memory.

Usage: python clean_exit_worker.py DIRECTORY
"""

import sys

import keras
import numpy as np

import keras_dist as kd


class Net(kd.Trainer, keras.Model):
    pass


def build(cls=keras.Model, **kwargs):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.Dropout(0.2)(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = cls(inputs, outputs, **kwargs)
    model.compile(optimizer="adam", loss="mse")
    return model


def main(directory: str) -> None:
    kd.initialize()
    rng = np.random.default_rng(0)
    x = rng.random((128, 8), dtype="float32")
    y = rng.random((128, 1), dtype="float32")
    model = build()
    callbacks = [
        kd.DistributeCallback(kd.DataParallel()),
        kd.Checkpoint(directory, save_freq=5, max_to_keep=2),
    ]
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    weights = [keras.ops.convert_to_numpy(v) for v in model.weights]
    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=callbacks[:1])
    model.predict(x, batch_size=16, verbose=0, callbacks=callbacks[:1])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks[:1])

    keras.config.set_dtype_policy("mixed_bfloat16")
    if keras.backend.backend() == "jax":
        distribution = kd.FSDP(offload="optimizer")
    else:
        distribution = kd.DataParallel()
    trainer = build(Net, distribution=distribution)
    keras.config.set_dtype_policy("float32")
    trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
    trainer.predict(x, batch_size=16, verbose=0)
    print("trained", len(weights), kd.process_id(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
