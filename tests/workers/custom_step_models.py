"""Models with the user's own steps, after keras.io's "customizing what happens
in fit()" guides, and the scenarios that train each one twice: with plain Keras
on one device and under keras_dist. Used in one process (JAX, TensorFlow with
simulated devices) and by `custom_steps_worker.py` (PyTorch, 2 processes).

The data (45 rows, global batch 12) leaves a last batch of 9 rows, which
divides neither 2 processes nor 4 or 8 devices: keras_dist pads it (PyTorch,
TensorFlow) or lays it out whole (JAX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import worker_seed
from keras import ops

import keras_dist as kd

BACKEND = keras.backend.backend()
ROWS, BATCH, EPOCHS = 45, 12, 2


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=(ROWS,)).astype("float32")
    return x, y, weights


def _loss_and_gradients(compute: Callable[[], Any], variables: list) -> tuple:
    """`compute()` -> (loss, aux), and the loss' gradients for `variables`, the
    way a custom step on this backend computes them (stateful backends)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf  # noqa: PLC0415

        with tf.GradientTape() as tape:
            loss, aux = compute()
        return loss, aux, tape.gradient(loss, variables)
    for variable in variables:
        variable.value.grad = None
    loss, aux = compute()
    loss.backward()
    return loss, aux, [variable.value.grad for variable in variables]


def _apply(optimizer: Any, gradients: list, variables: list) -> None:
    if BACKEND == "torch":
        import torch  # noqa: PLC0415

        with torch.no_grad():
            optimizer.apply(gradients, variables)
    else:
        optimizer.apply_gradients(zip(gradients, variables, strict=True))


# -- keras.io: "a first simple example" (x, y = data; compiled loss, metrics) --
class GuideModel(keras.Model):
    def train_step(self, data: Any) -> dict:
        x, y = data

        def compute() -> tuple:
            y_pred = self(x, training=True)
            return self.compute_loss(y=y, y_pred=y_pred), y_pred

        loss, y_pred, grads = _loss_and_gradients(compute, self.trainable_variables)
        _apply(self.optimizer, grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class JaxGuideModel(keras.Model):
    """The JAX guide's version: stateless, `compute_loss_and_updates` with the
    guide's own signature (no metrics variables)."""

    def compute_loss_and_updates(
        self, trainable_variables, non_trainable_variables, x, y, training=False
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        import jax  # noqa: PLC0415

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(
            trainable, non_trainable, x, y, training=True
        )
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        new_metrics_variables, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_variables)
            own = metrics_variables[start : start + len(metric.variables)]
            if metric.name == "loss":
                own = metric.stateless_update_state(own, loss)
            else:
                own = metric.stateless_update_state(own, y, y_pred)
            logs[metric.name] = metric.stateless_result(own)
            new_metrics_variables += own
        state = (trainable, non_trainable, optimizer_variables, new_metrics_variables)
        return logs, state


# -- keras.io: own loss tracker and metric, with sample weights -----------------
class TrackerModel(keras.Model):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    @property
    def metrics(self) -> list:
        return [self.loss_tracker, self.mae_metric]

    def train_step(self, data: Any) -> dict:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        def compute() -> tuple:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)
            loss = ops.sum(loss * sample_weight) / ops.cast(ops.shape(y)[0], "float32")
            return loss, y_pred

        loss, y_pred, grads = _loss_and_gradients(compute, self.trainable_variables)
        _apply(self.optimizer, grads, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}


class JaxTrackerModel(TrackerModel):
    """The JAX guide's "going lower-level" version: stateless, own tracker and
    metric, sample weights."""

    def train_step(self, state, data):
        import jax  # noqa: PLC0415

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        def compute(trainable, non_trainable):
            y_pred, non_trainable = self.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = keras.losses.mean_squared_error(y, y_pred)
            loss = ops.sum(loss * sample_weight) / ops.cast(ops.shape(y)[0], "float32")
            return loss, (y_pred, non_trainable)

        (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(
            compute, has_aux=True
        )(trainable, non_trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        tracker_variables = self.loss_tracker.stateless_update_state(
            metrics_variables[:2], loss
        )
        mae_variables = self.mae_metric.stateless_update_state(
            metrics_variables[2:], y, y_pred, sample_weight=sample_weight
        )
        logs = {
            "loss": self.loss_tracker.stateless_result(tracker_variables),
            "mae": self.mae_metric.stateless_result(mae_variables),
        }
        metrics_variables = [*tracker_variables, *mae_variables]
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


# -- keras.io: a GAN-style step, two models and two optimizers -----------------
class TwoOptimizerModel(keras.Model):
    """A generator maps a (deterministic) code of the input to fake rows; a
    discriminator tells real from fake. Each has its own optimizer. The data
    carries sample weights (ones), as keras_dist documents for steps that
    compute their own losses, so padding rows never count."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.generator = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(6, name="g")], name="generator"
        )
        self.discriminator = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(1, name="d")], name="discriminator"
        )
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self) -> list:
        return [self.d_tracker, self.g_tracker]

    def compile(self, d_optimizer: Any, g_optimizer: Any) -> None:
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, x: Any) -> Any:
        return self.discriminator(x)

    def train_step(self, data: Any) -> dict:
        real, _, weight = keras.utils.unpack_x_y_sample_weight(data)
        code = real[:, :3] * 0.5
        both = ops.concatenate([weight, weight], 0)
        labels = ops.concatenate([ops.ones_like(weight), ops.zeros_like(weight)], 0)

        def d_loss() -> tuple:
            fake = self.generator(code)
            logits = self.discriminator(ops.concatenate([real, fake], 0))
            return self.loss_fn(labels[:, None], logits, sample_weight=both), None

        d_variables = self.discriminator.trainable_variables
        loss_d, _, grads = _loss_and_gradients(d_loss, d_variables)
        _apply(self.d_optimizer, grads, d_variables)

        def g_loss() -> tuple:
            logits = self.discriminator(self.generator(code))
            return self.loss_fn(
                ops.ones_like(logits), logits, sample_weight=weight
            ), None

        g_variables = self.generator.trainable_variables
        loss_g, _, grads = _loss_and_gradients(g_loss, g_variables)
        _apply(self.g_optimizer, grads, g_variables)
        self.d_tracker.update_state(loss_d)
        self.g_tracker.update_state(loss_g)
        return {"d_loss": self.d_tracker.result(), "g_loss": self.g_tracker.result()}


# -- compute_loss only; test_step and predict_step overrides --------------------
class OwnLossModel(keras.Model):
    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.01 * ops.sum(ops.square(self.trainable_variables[0]))


class OutputLossModel(keras.Model):
    """A term of its own over the predictions' rows (issue 25, item 11):
    padding rows must not enter it."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        zeros = ops.zeros_like(y_pred)
        return loss + 0.5 * keras.losses.MeanSquaredError()(zeros, y_pred)


class EvaluatePredictModel(keras.Model):
    def test_step(self, data: Any) -> dict:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        self._loss_tracker.update_state(loss)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def predict_step(self, *args: Any) -> Any:
        data = args[-1]
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if BACKEND == "jax":
            trainable, non_trainable = args[0]
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
            return {"twice": 2.0 * y_pred, "first": y_pred[:, :1]}, non_trainable
        y_pred = self(x, training=False)
        return {"twice": 2.0 * y_pred, "first": y_pred[:, :1]}


class JaxEvaluatePredictModel(EvaluatePredictModel):
    def test_step(self, state, data):
        trainable, non_trainable, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
        loss, (trainable, non_trainable, metrics_variables) = (
            self.stateless_compute_loss(
                trainable,
                non_trainable,
                metrics_variables,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=False,
            )
        )
        mapping = list(zip(self.metrics_variables, metrics_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._loss_tracker.update_state(loss)
            logs = self.compute_metrics(x, y, y_pred, sample_weight)
        metrics_variables = [
            scope.get_current_value(v)
            if scope.get_current_value(v) is not None
            else value
            for v, value in mapping
        ]
        return logs, (trainable, non_trainable, metrics_variables)


def _network(cls: type) -> keras.Model:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="out")(hidden)
    return cls(inputs, outputs)


def _multi_output() -> keras.Model:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    cls_out = keras.layers.Dense(2, activation="softmax", name="cls")(hidden)
    reg_out = keras.layers.Dense(1, name="reg")(hidden)
    return keras.Model(inputs, {"cls": cls_out, "reg": reg_out})


def _weights(model: keras.Model) -> list[list]:
    return [np.asarray(w).tolist() for w in model.get_weights()]


def _callbacks(distribution: Any) -> list:
    """One DistributeCallback per call, or none for plain Keras."""
    return [] if distribution is None else [kd.DistributeCallback(distribution)]


def train(name: str, distribution: Any = None) -> dict:
    """Train scenario `name` (plain Keras when `distribution` is None)."""
    callbacks = _callbacks(distribution)
    x, y, weights = data()
    worker_seed.set_random_seed(7)
    result: dict = {}
    fit_kwargs: dict = {"batch_size": BATCH, "epochs": EPOCHS, "shuffle": False}
    if name == "guide":
        model = _network(JaxGuideModel if BACKEND == "jax" else GuideModel)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(x, y, verbose=0, callbacks=callbacks, **fit_kwargs)
    elif name == "tracker":
        model = _network(JaxTrackerModel if BACKEND == "jax" else TrackerModel)
        model.compile(optimizer=keras.optimizers.Adam(0.02))
        history = model.fit(
            x, y, sample_weight=weights, verbose=0, callbacks=callbacks, **fit_kwargs
        )
    elif name == "two_optimizers":
        model = TwoOptimizerModel()
        model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05))
        model.build((None, 6))
        model.generator.build((None, 3))
        ones = np.ones((ROWS,), "float32")
        history = model.fit(
            x, y, sample_weight=ones, verbose=0, callbacks=callbacks, **fit_kwargs
        )
    elif name == "own_loss":
        model = _network(OwnLossModel)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(
            x,
            y,
            verbose=0,
            callbacks=callbacks,
            validation_data=(x[:13], y[:13]),
            **fit_kwargs,
        )
    elif name == "output_loss":
        model = _network(OutputLossModel)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(x, y, verbose=0, callbacks=callbacks, **fit_kwargs)
    elif name == "evaluate_predict":
        model = _network(
            JaxEvaluatePredictModel if BACKEND == "jax" else EvaluatePredictModel
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(
            x,
            y,
            verbose=0,
            callbacks=callbacks,
            **fit_kwargs,
        )
        callbacks = _callbacks(distribution)
        result["evaluate"] = model.evaluate(
            x,
            y,
            sample_weight=weights,
            batch_size=BATCH,
            verbose=0,
            callbacks=callbacks,
            return_dict=True,
        )
        callbacks = _callbacks(distribution)
        predictions = model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks)
        result["predict"] = {k: np.asarray(v).tolist() for k, v in predictions.items()}
    elif name == "multi_output":
        model = _multi_output()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.5},
        )
        targets = {"cls": (y[:, 0] > 0).astype("int32"), "reg": y}
        history = model.fit(
            x,
            targets,
            verbose=0,
            callbacks=callbacks,
            validation_data=(x[:13], {"cls": targets["cls"][:13], "reg": y[:13]}),
            **fit_kwargs,
        )
        callbacks = _callbacks(distribution)
        result["evaluate"] = model.evaluate(
            x,
            targets,
            batch_size=BATCH,
            verbose=0,
            callbacks=callbacks,
            return_dict=True,
        )
    else:
        raise ValueError(f"unknown scenario {name!r}")
    result["weights"] = _weights(model)
    result["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
    result["evaluate"] = {k: float(v) for k, v in result.get("evaluate", {}).items()}
    return result


SCENARIOS = (
    "guide",
    "tracker",
    "two_optimizers",
    "own_loss",
    "output_loss",
    "evaluate_predict",
    "multi_output",
)


def assert_same(
    ours: dict, plain: dict, atol: float = 1e-5, except_logs: frozenset = frozenset()
) -> None:
    """keras_dist's run equals plain Keras' on one device (`except_logs`: log
    keys whose values are not compared; they must still be there)."""
    for got, expected in zip(ours["weights"], plain["weights"], strict=True):
        np.testing.assert_allclose(got, expected, atol=atol, rtol=0)
    assert set(ours["history"]) == set(plain["history"])
    for key, values in plain["history"].items():
        if key in except_logs:
            continue
        np.testing.assert_allclose(ours["history"][key], values, atol=atol, err_msg=key)
    assert set(ours["evaluate"]) == set(plain["evaluate"])
    for key, value in plain["evaluate"].items():
        if key in except_logs:
            continue
        np.testing.assert_allclose(ours["evaluate"][key], value, atol=atol, err_msg=key)
    for key, values in plain.get("predict", {}).items():
        np.testing.assert_allclose(ours["predict"][key], values, atol=atol, err_msg=key)
