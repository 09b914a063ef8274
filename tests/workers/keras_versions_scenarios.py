"""The model, data and probes of the Keras-version tests
(tests/test_keras_versions.py), shared by the test process (plain Keras on
one device, the reference) and the job's workers (keras_versions_worker.py).

24 training rows in batches of 8 (3 steps) and 17 validation rows (8, 8, 1:
the last batch is padded wherever it is split), 2 epochs, shuffled. Column 0
of `x` is the row's id (1...), so a layer can record which rows a process
computed on (padding rows are zeros: id 0).
"""

from __future__ import annotations

import keras
import numpy as np
import worker_seed

SEED = 7
TRAIN_ROWS = 24
VAL_ROWS = 17
BATCH = 8
EPOCHS = 2
STEPS = -(-TRAIN_ROWS // BATCH)


def data() -> tuple[np.ndarray, ...]:
    """`x_train, y_train, x_val, y_val`; ids 1..24 and 101..117."""
    rng = np.random.default_rng(0)
    rows = TRAIN_ROWS + VAL_ROWS
    x = rng.normal(size=(rows, 4)).astype("float32")
    ids = np.concatenate(
        [np.arange(1, TRAIN_ROWS + 1), np.arange(101, 101 + VAL_ROWS)]
    ).astype("float32")
    x[:, 0] = ids / 100.0  # small, as the other features
    y = (x @ np.array([[0.5], [-1.0], [2.0], [0.3]], "float32")).astype("float32")
    return x[:TRAIN_ROWS], y[:TRAIN_ROWS], x[TRAIN_ROWS:], y[TRAIN_ROWS:]


def row_id(value: float) -> int:
    return int(round(float(value) * 100.0))


class RowCount(keras.metrics.Metric):
    """The number of (real) rows seen: a metric whose result is a sum, which a
    second summation over processes would double (ratio metrics hide it)."""

    def __init__(self, name: str = "rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(
            shape=(), initializer="zeros", aggregation="sum", name="total"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        rows = keras.ops.cast(keras.ops.shape(y_true)[0], "float32")
        if sample_weight is not None:
            # keras_dist's padding rows come with weight 0.
            rows = keras.ops.sum(keras.ops.cast(sample_weight, "float32"))
        self.total.assign_add(rows)

    def result(self):
        # A copy: on PyTorch the variable's own storage would change under
        # logs already taken (validation resets the state in place).
        return keras.ops.copy(self.total.value)


class RecordRows(keras.layers.Layer):
    """Identity; on PyTorch (eager) records the ids of the rows it computes
    on into `seen[phase]` (padding rows left out)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.phase = "other"
        self.seen: dict[str, list[int]] = {}

    def call(self, x):
        if keras.backend.backend() == "torch" and not isinstance(x, keras.KerasTensor):
            ids = [row_id(v) for v in keras.ops.convert_to_numpy(x[:, 0])]
            self.seen.setdefault(self.phase, []).extend(i for i in ids if i)
        return x


def build(model_class: type = keras.Model, **kwargs) -> keras.Model:
    """The functional regression model, compiled (`model_class`: e.g. a
    `kd.Trainer` subclass, which takes `distribution=` in `kwargs`)."""
    worker_seed.set_random_seed(SEED)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="hidden")(RecordRows(name="record")(inputs))
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        metrics=[RowCount(), "mae"],
    )
    return model


class InsideTheRun(keras.callbacks.Callback):
    """Tags the rows the model computes on by phase (`train:<epoch>`,
    `val:<epoch>`), and at the last epoch's end runs `predict` and `evaluate`
    inside the run (the distribution still on)."""

    def __init__(self, x_val: np.ndarray, y_val: np.ndarray):
        super().__init__()
        self._x, self._y = x_val, y_val
        self.inner: dict = {}

    def _phase(self, phase: str) -> None:
        self.model.get_layer("record").phase = phase

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._phase(f"train:{epoch}")

    def on_test_begin(self, logs=None):
        self._phase(f"val:{self._epoch}")

    def on_epoch_end(self, epoch, logs=None):
        if epoch != EPOCHS - 1:
            return
        self._phase("inner")
        predictions = self.model.predict(self._x, batch_size=BATCH, verbose=0)
        evaluation = self.model.evaluate(
            self._x, self._y, batch_size=BATCH, verbose=0, return_dict=True
        )
        self.inner = {
            "predictions": np.asarray(predictions).tolist(),
            "evaluate": {k: float(v) for k, v in evaluation.items()},
        }
        self._phase("other")


def fit(model: keras.Model, callbacks: list) -> dict:
    """fit with validation; what the tests compare."""
    x, y, x_val, y_val = data()
    inside = InsideTheRun(x_val, y_val)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        validation_data=(x_val, y_val),
        callbacks=[inside, *callbacks],
    ).history
    return {
        "history": {k: [float(v) for v in values] for k, values in history.items()},
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "inner": inside.inner,
        "seen": model.get_layer("record").seen,
    }


def reference() -> dict:
    """Plain Keras on one device."""
    return fit(build(), [])
