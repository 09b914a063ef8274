"""A pytest plugin: Keras' own tests, every `fit`/`evaluate`/`predict` distributed.

Loaded with `-p tests.keras_own.plugin` by `tests/keras_own/run.sh`, it wraps
`keras.Model.fit`, `evaluate` and `predict` so that each call gets
`kd.DistributeCallback(kd.DataParallel())` added to the callbacks the test
wrote (never in place of one: a test's own callbacks stay, in their order, and
a call that already has a `DistributeCallback` is left alone). Keras' test
files ship in its wheel (`keras/src/**/*_test.py`), so the installed release's
own tests run, on whatever backend `KERAS_BACKEND` names.
"""

from __future__ import annotations

import functools

import keras

import keras_dist as kd

_WRAPPED = ("fit", "evaluate", "predict")


def _with_distribution(method):
    @functools.wraps(method)
    def call(self, *args, callbacks=None, **kwargs):
        if callbacks is None:
            callbacks = []
        elif not isinstance(callbacks, (list, tuple)):
            # A `CallbackList` or one callback: Keras' own handling decides.
            return method(self, *args, callbacks=callbacks, **kwargs)
        callbacks = list(callbacks)
        if not any(isinstance(c, kd.DistributeCallback) for c in callbacks):
            callbacks.append(kd.DistributeCallback(kd.DataParallel()))
        return method(self, *args, callbacks=callbacks, **kwargs)

    call.__keras_own_distributed__ = True
    return call


def pytest_configure(config):
    for name in _WRAPPED:
        method = getattr(keras.Model, name)
        if not getattr(method, "__keras_own_distributed__", False):
            setattr(keras.Model, name, _with_distribution(method))
