"""The state `fit` ends with is saved, on every backend (issue 25).

26 steps with `save_freq=10`: checkpoints of steps 10, 20 and 26 (the last
one committed before `fit` returns, background save and all); `kd.restore`
gives the final weights exactly, and a second `fit` trains nothing. Dropout,
blocking saves and the mid-epoch cases: `test_checkpoint_resume.py` (JAX,
PyTorch).
"""

from __future__ import annotations

import keras
import numpy as np

import keras_dist as kd
from keras_dist.checkpoint import store

STEPS, BATCH, SAVE_FREQ = 26, 8, 10


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class _Steps(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _fit(directory) -> tuple[keras.Model, int]:
    model, steps = _model(), _Steps()
    x = np.random.default_rng(0).normal(size=(STEPS * BATCH, 4)).astype("float32")
    model.fit(
        x,
        x.sum(axis=1, keepdims=True),
        batch_size=BATCH,
        epochs=1,
        shuffle=True,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(directory, save_freq=SAVE_FREQ, max_to_keep=None),
            steps,
        ],
    )
    return model, steps.steps


def test_the_last_step_is_saved_and_a_second_fit_trains_nothing(tmp_path):
    directory = tmp_path / "ck"
    model, steps = _fit(directory)
    assert steps == STEPS
    assert store.complete_steps(str(directory)) == [10, 20, STEPS]
    final = model.get_weights()
    restored = _model()
    assert kd.restore(restored, directory) == STEPS
    for ours, theirs in zip(restored.get_weights(), final, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    again, steps = _fit(directory)
    assert steps == 0
    assert int(keras.ops.convert_to_numpy(again.optimizer.iterations)) == STEPS
    for ours, theirs in zip(again.get_weights(), final, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert store.complete_steps(str(directory)) == [10, 20, STEPS]
