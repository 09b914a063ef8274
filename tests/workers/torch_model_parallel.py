"""ModelParallel scenarios of the PyTorch worker (DTensor), run by torch_worker.py.

The worker has called `kd.initialize()` before importing this module.
"""

from __future__ import annotations

import keras
import numpy as np
import scenarios
import torch
import worker_seed
from torch.distributed.tensor import DTensor

import keras_dist as kd

# Column-sharded first kernel and bias, row-sharded second kernel; the last
# bias stays replicated.
LAYOUTS = {
    "dense/kernel": (None, "model"),
    "dense/bias": ("model",),
    "dense_1/kernel": ("model", None),
    # A layer output relaid out (Keras' LayoutMap "<layer>/output" entries):
    # replicated, where the column-sharded kernel leaves it sharded.
    "dense/output": (None, None),
}


def _model_parallel(batch: int = 1) -> kd.ModelParallel:
    world = kd.num_processes()
    mesh = kd.DeviceMesh((batch, world // batch), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _held(variable: keras.Variable) -> list:
    """[kind, local shape, placements] of what this process holds of `variable`."""
    value = variable.value
    if isinstance(value, DTensor):
        placements = [str(p) for p in value.placements]
        return ["DTensor", list(value.to_local().shape), placements]
    return [type(value).__name__, list(value.shape), []]


class RecordShards(keras.callbacks.Callback):
    """What each variable is while the first training batch ends."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, list] = {}
        self.weights_in_fit: list | None = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0 and not self.held:
            variables = [*self.model.weights, *self.model.optimizer.variables]
            self.held = {v.path: _held(v) for v in variables}
            # Gathers the sharded variables (every process does it).
            self.weights_in_fit = [w.shape for w in self.model.get_weights()]


def _fsdp(batch: int) -> kd.FSDP:
    """Every variable split along "batch" where 2 divides it (min_size=0); with
    `batch` < the process count, also the LAYOUTS along "model"."""
    world = kd.num_processes()
    if batch == world:
        return kd.FSDP(min_size=0)
    mesh = kd.DeviceMesh((batch, world // batch), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    return kd.FSDP(layout_map=layout_map, min_size=0)


def train(sharded: bool, batch: int = 1, fsdp: bool = False) -> dict:
    """fit (with validation), predict and evaluate the classification model
    under ModelParallel on a (batch, N / batch) mesh, or under a one-process
    DataParallel (`sharded=False`, the reference: the same shuffle stream,
    nothing sharded)."""
    # Different seeds on purpose: process 0's weights must win everywhere.
    worker_seed.set_random_seed(100 + kd.process_id())
    x, _ = scenarios.classification_data()
    model = scenarios.classification_model()
    if fsdp:
        distribution = _fsdp(batch)
    elif sharded:
        distribution = _model_parallel(batch)
    else:
        distribution = kd.DataParallel()
    record = RecordShards()
    # The rows the first layer computes on in this process, first two calls.
    input_rows: list[int] = []

    def count_rows(layer, args):
        value = args[0]
        if len(input_rows) < 2 and value.device.type != "meta":  # not Keras' build
            local = value.to_local() if isinstance(value, DTensor) else value
            input_rows.append(int(local.shape[0]))

    # How the second Dense layer receives the first one's output.
    relaid: list[list[str]] = []

    def record_placements(layer, args):
        value = args[0]
        if not relaid and value.device.type != "meta":
            relaid.append([str(p) for p in getattr(value, "placements", [])])

    hooks = [
        model.layers[0].register_forward_pre_hook(count_rows),
        model.layers[1].register_forward_pre_hook(record_placements),
    ]
    result = scenarios.fit_predict_evaluate(
        model, distribution, shuffle=True, verbose=0, fit_callbacks=(record,)
    )
    for hook in hooks:
        hook.remove()
    return {
        **result,
        "plain_predictions": keras.ops.convert_to_numpy(model(x)).tolist(),
        "held_in_fit": record.held,
        "weight_shapes_in_fit": [list(s) for s in record.weights_in_fit],
        "held_after": {v.path: _held(v) for v in model.weights},
        "input_rows": input_rows,
        "second_layer_input": relaid[0] if relaid else None,
        # kd.distribute_tensor: columns split over the "model" axis.
        "distributed_columns": kd.distribute_tensor(
            np.arange(8, dtype="float32").reshape(2, 4),
            kd.TensorLayout((None, "model"), distribution.device_mesh),
        )
        .to_local()
        .tolist()
        if sharded and "model" in distribution.device_mesh.axis_names
        else None,
    }


def _conv_fit(layouts: dict[str, tuple]) -> dict:
    """fit a Conv2D whose variables `layouts` shard on their output channels."""
    worker_seed.set_random_seed(1)
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    for key, axes in layouts.items():
        layout_map[key] = axes
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(8, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((8, 6, 6, 2), "float32")
    callback = kd.DistributeCallback(kd.ModelParallel(layout_map=layout_map))
    error = None
    try:
        model.fit(x, np.zeros((8, 3), "float32"), batch_size=4, callbacks=[callback])
    except NotImplementedError as raised:
        error = str(raised)
    finally:
        callback.close()
    # The failed call left an ordinary model behind.
    after = keras.ops.convert_to_numpy(model(torch.as_tensor(x[:2])))
    return {
        "error": error,
        "works_after": bool(np.isfinite(after).all()),
        "kinds_after": sorted({type(v.value).__name__ for v in model.weights}),
    }


def unsupported_op() -> dict:
    """Conv2D kernels sharded on their output channels, which DTensor cannot run
    in this torch release: with the bias sharded too, and without."""
    kernel = {"conv/kernel": (None, None, None, "model")}
    return {
        "kernel_and_bias": _conv_fit({**kernel, "conv/bias": ("model",)}),
        "kernel_only": _conv_fit(kernel),
    }


def callbacks_and_errors() -> dict:
    """Callbacks that assign weights during a sharded call, listed before the
    DistributeCallback (as the Trainer mixin does), against the same fit on
    one device in this process; and an error of the model's own."""
    x, y = scenarios.classification_data()

    class AssignBack(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.set_weights(self.model.get_weights())

    def fit(distribution: kd.Distribution | None) -> list:
        worker_seed.set_random_seed(7)
        model = scenarios.classification_model()
        callbacks = [
            keras.callbacks.EarlyStopping(
                monitor="loss", patience=5, restore_best_weights=True
            ),
            AssignBack(),
        ]
        if distribution is not None:
            callbacks.append(kd.DistributeCallback(distribution))
        model.fit(
            x, y, batch_size=12, epochs=3, shuffle=False, verbose=0, callbacks=callbacks
        )
        return model.get_weights()

    sharded = fit(_model_parallel())
    one_device = fit(None)

    class Check(keras.layers.Layer):
        def call(self, inputs, training=None):
            if training:
                raise ValueError("the model's own check failed")
            return inputs

    worker_seed.set_random_seed(7)
    failing = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, name="dense"), Check()]
    )
    failing.compile(optimizer="adam", loss="mse")
    callback = kd.DistributeCallback(_model_parallel())
    try:
        failing.fit(x, y[:, :1], batch_size=12, verbose=0, callbacks=[callback])
        error = None
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
    finally:
        callback.close()
    return {
        "max_difference": max(
            float(np.max(np.abs(ours - theirs)))
            for ours, theirs in zip(sharded, one_device, strict=True)
        ),
        "own_error": error,
    }


def run(scenario: str) -> dict:
    if scenario == "model_parallel":
        return train(sharded=True)
    if scenario == "model_parallel_fsdp":
        return train(sharded=True, batch=kd.num_processes(), fsdp=True)
    if scenario == "model_parallel_fsdp_alone":
        # Every variable split along its first dimension gets collectives of
        # its own (a large one's path, on this small model): gathered into and
        # reduce-scattered from its own whole tensor, beside the bundled ones.
        from keras_dist.backends.torch import fsdp_compute

        own_collective_bytes = fsdp_compute._OWN_COLLECTIVE_BYTES
        fsdp_compute._OWN_COLLECTIVE_BYTES = 0
        try:
            return train(sharded=True, batch=kd.num_processes(), fsdp=True)
        finally:  # for the scenarios after this one in the same job
            fsdp_compute._OWN_COLLECTIVE_BYTES = own_collective_bytes
    if scenario == "model_parallel_fsdp_2x2":
        return train(sharded=True, batch=2, fsdp=True)
    if scenario == "model_parallel_reference":
        return train(sharded=False)
    if scenario == "model_parallel_callbacks":
        return callbacks_and_errors()
    if scenario == "model_parallel_unsupported_op":
        return unsupported_op()
    raise ValueError(f"Unknown ModelParallel scenario: {scenario!r}")
