"""Every Keras private internal the PyTorch adapter relies on, in one place.

`tests/test_keras_internals.py` calls `check()` and fails loudly when a Keras
release moves any of these. The adapter hands in the collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import torch
from keras.src.trainers.data_adapters import (
    data_adapter_utils,
    torch_data_loader_adapter,
)
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

from keras_dist.backends.torch import unused_weights
from keras_dist.backends.torch.metric_sync import (
    MetricSync,
    mark_metric_states,
    metric_state_is_per_process,
)
from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.padding import masked_row_weights
from keras_dist.common.step_rows import (
    STEP_METHODS,
    StepRows,
    data_for_step,
    global_logs,
    make_rows,
    overridden,
    step_rows,
    warn_padded_once,
)
from keras_dist.keras_compat import backend as keras_backends
from keras_dist.keras_compat import torch_trainer
from keras_dist.keras_compat.data_adapters import shuffles_from_adapter_epoch
from keras_dist.keras_compat.epoch_iterator import EpochRouting
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.metrics import update_compiled_metrics
from keras_dist.keras_compat.steps import uses_keras_compute_metrics

# Wherever this Keras keeps them (`keras_compat.backend`).
torch_core = keras_backends.ops_module("torch")
TorchTrainer = keras_backends.trainer_class("torch")
TorchEpochIterator = keras_backends.epoch_iterator_class("torch")
_epochs = EpochRouting(TorchEpochIterator)
# keras_dist lays out its policies' torch variables when a run starts; Keras
# 3.16 would make them DTensors at creation from a layout it cannot read.
torch_trainer.keep_variables_plain(
    lambda distribution: getattr(distribution, "lays_out_variables_itself", False)
)


@dataclass
class Collectives:
    """What the steps need from torch.distributed, as plain callables."""

    world_size: int
    # Starts summing a float tensor over processes in place; returns the wait.
    start_sum: Callable[[Any], Callable[[], None]]
    gather_from_processes: Callable[[Any], Any]  # rows of every process, in rank order
    # Averages a list of gradients (None entries kept) over the processes.
    average_gradients: Callable[[list[Any]], list[Any]]
    forward: Callable[..., Any]  # the model's forward through DDP
    no_grad: Callable[[], Any]
    # A context for a micro-step's backward, whose gradients stay un-reduced
    # (DDP's `no_sync`; a null one when averaged after backward), or None.
    skip_gradient_sync: Callable[[], Any] | None = None
    # A context around the loss computation (FSDP's plain compute: weight
    # regularizers read whole weights in it).
    loss_scope: Callable[[], Any] = contextlib.nullcontext
    # Averages the variables' `.grad` in place after backward (None: DDP does).
    average_after_backward: Callable[[list[Any]], None] | None = None


def check() -> list[str]:
    """Names of the internals that this Keras release no longer has."""
    missing = []
    if not hasattr(TorchEpochIterator, "_get_iterator"):
        missing.append("TorchEpochIterator._get_iterator")
    if not (_shuffles_from_torch_generator() or _shuffles_from_adapter_epoch()):
        missing.append(
            "ArrayDataAdapter.get_torch_dataloader shuffles from torch's generator "
            "(<= 3.15) or from the adapter's epoch counter (3.16)"
        )
    loader_adapter = getattr(torch_data_loader_adapter, "TorchDataLoaderAdapter", None)
    if loader_adapter is None:
        missing.append(
            "keras.src.trainers.data_adapters.torch_data_loader_adapter."
            "TorchDataLoaderAdapter"
        )
    elif not hasattr(loader_adapter, "get_torch_dataloader"):
        missing.append("TorchDataLoaderAdapter.get_torch_dataloader")
    for name in ("train_step", "test_step", "predict_step", "_compute_loss"):
        if not hasattr(TorchTrainer, name):
            missing.append(f"TorchTrainer.{name}")
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(loss="mse")
    if not hasattr(model, "_loss_tracker"):
        missing.append("Trainer._loss_tracker")
    metric = keras.metrics.Mean()
    if any(not hasattr(v, "aggregation") for v in metric.variables):
        missing.append("Variable.aggregation")
    missing += _check_variable_storage()
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    if not hasattr(dense, "_trainable_variables") or [
        id(v) for v in own_trainable_variables(dense)
    ] != [id(dense.kernel), id(dense.bias)]:
        missing.append("Layer._trainable_variables (a layer's own variables)")
    norm = keras.layers.BatchNormalization()
    norm.build((None, 3))
    if [id(v) for v in own_non_trainable_variables(norm)] != [
        id(norm.moving_mean),
        id(norm.moving_variance),
    ]:
        missing.append("Layer._non_trainable_variables (a layer's own variables)")
    if not isinstance(getattr(dense, "_losses", None), list):
        missing.append("Layer._losses (the losses add_loss collected)")
    mark_metric_states([metric.variables[0]], per_process=True)
    if not metric_state_is_per_process(metric.variables[0]):
        missing.append("an attribute set on a Keras Variable")
    missing += _check_gradient_accumulation()
    built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    graph = getattr(built, "_functional", None)
    if graph is None or not hasattr(graph, "_track_variables"):
        missing.append("Sequential._functional._track_variables")
    return missing


# -- input batches -------------------------------------------------------------
def data_loader_of(data_adapter: Any) -> Any:
    """The torch `DataLoader` that `fit` received, or None for other input.

    Keras wraps a DataLoader in its `TorchDataLoaderAdapter`, which hands the
    very same loader back from `get_torch_dataloader()`.
    """
    if isinstance(data_adapter, torch_data_loader_adapter.TorchDataLoaderAdapter):
        return data_adapter.get_torch_dataloader()
    return None


def keras_batches(data_adapter: Any) -> Any:
    """The global batches exactly as Keras' torch trainer reads them: its
    `DataLoader`, which shuffles arrays from torch's global generator."""
    return data_adapter.get_torch_dataloader()


def _loader_order(seed: int, epoch: int = 0) -> list[int]:
    adapter = ArrayDataAdapter(np.arange(32)[:, None], batch_size=32, shuffle=True)
    if epoch:
        adapter._epoch = epoch
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        (batch,) = iter(keras_batches(adapter))
    finally:
        torch.set_rng_state(saved)
    return [int(value) for value in np.asarray(batch[0]).reshape(-1)]


def _shuffles_from_torch_generator() -> bool:
    return _loader_order(0) == _loader_order(0) != _loader_order(1)


def _shuffles_from_adapter_epoch() -> bool:
    """Keras 3.16: the DataLoader's own generator is seeded from the adapter's
    epoch counter, whatever torch's global one holds."""
    return shuffles_from_adapter_epoch() and (
        _loader_order(0) == _loader_order(1) != _loader_order(0, epoch=1)
    )


def route_batches(source: Callable[[Any], Any]) -> None:
    """Feed every Keras epoch from `source(data_adapter)` until unrouted."""
    _epochs.route(source)


def unroute_batches() -> None:
    _epochs.unroute()


# -- steps ---------------------------------------------------------------------
def _weights(batch: Any) -> tuple[Any, Any, Any, Any, Any]:
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch.data)
    if sample_weight is None and batch.padded_rows == batch.global_rows:
        # Every row real, none weighted: Keras' own unweighted loss and metrics
        # give the same values (weights of one are exact) for fewer ops a step.
        return x, y, None, None, None
    mask = batch.mask
    weights = masked_row_weights(mask, sample_weight)
    # Each process' loss is over its share of the padded batch, the gradients
    # averaged over processes: this scale makes it the real rows' mean.
    loss_weights = weights * (batch.padded_rows / batch.global_rows)
    return x, y, mask, weights, loss_weights


def _metric_sync(
    model: Any, collectives: Collectives, *, average_non_trainable: bool
) -> MetricSync:
    return MetricSync(
        model,
        world_size=collectives.world_size,
        start_sum=collectives.start_sum,
        storage=variable_storage,
        average_non_trainable=average_non_trainable,
    )


def _update_metrics(
    model: Any,
    loss: Any,
    batch: Any,
    parts: tuple,
    world_size: int,
    keras_metrics: bool,
) -> None:
    """`keras_metrics`: the model keeps Keras' own `compute_metrics`
    (`uses_keras_compute_metrics`, asked once per run, not in the step)."""
    x, y, y_pred, mask, weights = parts
    # Each process' loss is (its rows' loss sum) * world_size / global_rows;
    # this weight makes the tracker's sums over processes the global mean.
    model._loss_tracker.update_state(loss, sample_weight=batch.global_rows / world_size)
    if keras_metrics:
        update_compiled_metrics(model, y, y_pred, mask, weights)
    else:
        model.compute_metrics(x, y, y_pred, weights)


def user_steps(model: Any) -> set[str]:
    """The step methods `model`'s class overrides: its own code, which keras_dist
    runs as written (see `custom_steps`). An own `compute_loss` makes Keras'
    train and test steps (which call it) the user's, as on the other backends:
    a term it adds over the predictions sees padding rows, which is said."""
    steps = set(overridden(model, TorchTrainer, STEP_METHODS))
    if overridden(model, TorchTrainer, ("compute_loss",)):
        steps |= {"train_step", "test_step"}
    return steps


def _rows(model: Any, batch: Any, collectives: Collectives, **options: Any) -> StepRows:
    """What a step on `batch` (this process' rows) knows of them."""
    return make_rows(
        model,
        batch.data,
        batch.mask,
        batch.padded_rows / batch.global_rows,
        batch.global_rows / collectives.world_size,
        **options,
    )


def _user_step(
    model: Any, step: str, batch: Any, collectives: Collectives, **options: Any
) -> Any:
    """The class' own `step` (the user's) on this process' rows of `batch`."""
    padded = batch.padded_rows != batch.global_rows
    if padded:
        warn_padded_once(model, step, batch.global_rows, batch.padded_rows)
    rows = _rows(model, batch, collectives, **options)
    with step_rows(rows), GlobalBatchNorm.rows(batch.mask, padded):
        return getattr(type(model), step)(model, data_for_step(batch.data, rows))


# -- gradient accumulation -------------------------------------------------------
class _LocalAccumulation:
    """Keras' `gradient_accumulation_steps=k` with one gradient all-reduce per
    k steps instead of one per step.

    Keras' optimizer adds each step's gradients into its accumulators and, on
    every k-th step, updates the weights with (accumulated + this step's) / k.
    Here the k - 1 micro-steps leave each process' gradients un-reduced (in
    DDP's `no_sync`, or without the all-reduce after backward); on the k-th
    step those sums move into `.grad` before backward, so that one all-reduce
    averages every micro-step's gradients at once: the same weights as plain
    Keras on one device. Not for a `LossScaleOptimizer`: whether it skips a
    step depends on its gradients, which must be the same on every process."""

    def __init__(self, optimizer: Any, steps: int):
        self._optimizer = optimizer
        self._steps = steps

    @classmethod
    def of(cls, model: Any, collectives: Collectives) -> _LocalAccumulation | None:
        optimizer = getattr(model, "optimizer", None)
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if (
            not steps
            or collectives.skip_gradient_sync is None
            or isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        ):
            return None
        return cls(optimizer, steps)

    def is_update_step(self) -> bool:
        """Whether this step's `apply` updates the weights (Keras' own test;
        the step counter is the same on every process)."""
        return (int(self._optimizer._iterations.value) + 1) % self._steps == 0

    def move_into_gradients(self, trainable: list[Any]) -> None:
        """Start each `.grad` from this process' accumulated gradients."""
        optimizer = self._optimizer
        if not optimizer.built:
            return
        for variable in trainable:
            accumulator = optimizer._accumulated_gradients[
                optimizer._get_variable_index(variable)
            ]
            variable.value.grad = accumulator.value.detach().clone()
            accumulator.value.zero_()


def _check_gradient_accumulation() -> list[str]:
    missing = []
    variable = keras.Variable([1.0, 2.0])
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    optimizer.build([variable])
    if not hasattr(optimizer, "_iterations"):
        missing.append("BaseOptimizer._iterations")
    if not hasattr(optimizer, "_get_variable_index"):
        missing.append("BaseOptimizer._get_variable_index")
    elif len(getattr(optimizer, "_accumulated_gradients", [])) != 1:
        missing.append("BaseOptimizer._accumulated_gradients")
    return missing


@torch.compiler.disable
def _backward_beside_sum(
    loss: Any,
    flat: Any,
    start_sum: Callable[[Any], Callable[[], None]],
    average: Callable[[list[Any]], None] | None,
    trainable: list[Any],
) -> None:
    """A compiled step's backward pass (where TorchDynamo breaks the graph
    either way), with the metric states' sum (`flat`) beside it, as in the
    eager step, and the gradients' all-reduce after it where DDP has none."""
    wait = start_sum(flat)
    loss.backward()
    if average is not None:
        average(trainable)
    wait()


def make_steps(
    model: Any, collectives: Collectives, user_steps: set[str] = frozenset()
) -> dict[str, Callable]:
    # None until the first step, then whether to look for weights the loss
    # does not reach on some process, under DDP (see `unused_weights`).
    look_for_unused: list[bool | None] = [None]
    world_size = collectives.world_size
    keras_metrics = uses_keras_compute_metrics(model)
    # The metric states' sums over the processes: each step's logs (with
    # BatchNorm's statistics), epoch logs and `evaluate`'s results.
    step_sums = _metric_sync(model, collectives, average_non_trainable=True)
    result_sums = _metric_sync(model, collectives, average_non_trainable=False)

    def rows_of(batch: Any, mask: Any, loss_weights: Any, weights: Any) -> StepRows:
        # The weights the step computed already (no extra work per step).
        return StepRows(
            model, mask, loss_weights, weights, batch.global_rows / world_size
        )

    def user_train_step(batch: Any) -> Any:
        logs = _user_step(
            model,
            "train_step",
            batch,
            collectives,
            average_gradients=collectives.average_gradients,
        )
        if collectives.world_size == 1:
            results = type(model).get_metrics_result(model)
        else:
            # With the metric states, the state gradients do not sync
            # (BatchNorm's moving statistics) is averaged.
            results = step_sums.results()
        return global_logs(model, logs, lambda: results)

    def user_test_step(batch: Any) -> Any:
        logs = _user_step(model, "test_step", batch, collectives)
        return global_logs(model, logs, get_metrics_result)

    def train_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights = _weights(batch)
        kwargs = {"training": True} if model._call_has_training_arg else {}
        accumulation = _LocalAccumulation.of(model, collectives)
        update = accumulation is None or accumulation.is_update_step()
        # A micro-step of gradient accumulation: no gradient all-reduce.
        local = contextlib.nullcontext if update else collectives.skip_gradient_sync
        padded = batch.padded_rows != batch.global_rows
        # Not a `with`: under `torch.compile` the step runs DDP's forward
        # (which TorchDynamo cannot trace) between two compiled parts, and
        # resumes after it only outside generator contexts.
        rows = GlobalBatchNorm.enter_rows(batch.mask, padded)
        if update:
            y_pred = collectives.forward(x, **kwargs)
        else:
            with local():
                y_pred = collectives.forward(x, **kwargs)
        GlobalBatchNorm.leave_rows(rows)
        model.zero_grad()
        with (
            step_rows(rows_of(batch, mask, loss_weights, weights)),
            collectives.loss_scope(),
        ):
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=True
            )
        _update_metrics(
            model,
            loss,
            batch,
            (x, y, y_pred, mask, weights),
            world_size,
            keras_metrics,
        )
        sync = traced = None
        if world_size > 1:
            # Metric states and BatchNorm statistics are final for this step:
            # their sum runs beside backward (compiled: in `_backward_beside_sum`,
            # or in the graph after backward where there is none to run beside).
            if torch.compiler.is_compiling():
                traced = step_sums.traced_copy()
            else:
                sync = step_sums.start()
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        trainable = model.trainable_weights[:]
        summed_beside_backward = False
        if trainable:
            if accumulation is not None and update:
                accumulation.move_into_gradients(trainable)
            unused = everywhere = []
            average = collectives.average_after_backward  # None: DDP averages
            if world_size > 1 and average is None and look_for_unused[0] is not False:
                unused = unused_weights.missed_by(loss, trainable)
                anywhere, everywhere = unused_weights.agree(
                    unused, trainable, collectives.start_sum, world_size
                )
                if look_for_unused[0] is None:
                    look_for_unused[0] = bool(anywhere)
                loss = unused_weights.reach(loss, unused)
            if update and traced is not None:
                _backward_beside_sum(
                    loss, traced.flat, collectives.start_sum, average, trainable
                )
                summed_beside_backward = True
            elif update:
                loss.backward()
                if average is not None:
                    average(trainable)
            else:
                with local():
                    loss.backward()
            unused_weights.forget(everywhere)
            with collectives.no_grad():
                model.optimizer.apply([v.value.grad for v in trainable], trainable)
        if sync is not None:
            return sync.finish()
        if traced is not None:
            if not summed_beside_backward:
                collectives.start_sum(traced.flat)()
            return traced.finish()
        return type(model).get_metrics_result(model)

    def test_step(batch: Any) -> Any:
        x, y, mask, weights, loss_weights = _weights(batch)
        kwargs = {"training": False} if model._call_has_training_arg else {}
        y_pred = model(x, **kwargs)
        with (
            step_rows(rows_of(batch, mask, loss_weights, weights)),
            collectives.loss_scope(),
        ):
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=loss_weights, training=False
            )
        _update_metrics(
            model,
            loss,
            batch,
            (x, y, y_pred, mask, weights),
            world_size,
            keras_metrics,
        )
        return model.get_metrics_result()

    def predict_step(batch: Any) -> Any:
        if "predict_step" in user_steps:
            y_pred = type(model).predict_step(model, batch.data)
        else:
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch.data)
            kwargs = {"training": False} if model._call_has_training_arg else {}
            y_pred = model(x, **kwargs)
        if batch.own_predictions:
            real = batch.mask > 0
            return keras.tree.map_structure(lambda output: output[real], y_pred)
        real = collectives.gather_from_processes(batch.mask) > 0
        # Every process gets the whole prediction, in input order.
        return keras.tree.map_structure(
            lambda output: collectives.gather_from_processes(output)[real], y_pred
        )

    def get_metrics_result() -> dict[str, Any]:
        # Keras reads epoch logs and `evaluate`'s result from here too.
        if world_size == 1 or not model.metrics_variables:
            return type(model).get_metrics_result(model)
        return result_sums.results()

    return {
        "train_step": user_train_step if "train_step" in user_steps else train_step,
        "test_step": user_test_step if "test_step" in user_steps else test_step,
        "predict_step": predict_step,
        "get_metrics_result": get_metrics_result,
    }


# -- variables held as DTensors (ModelParallel) ----------------------------------
def variable_storage(variable: Any) -> Any:
    """The torch `Parameter` a Keras variable holds (`Variable._value`)."""
    return variable._value


def set_variable_storage(variable: Any, parameter: Any) -> None:
    """Make a Keras variable hold `parameter` (a torch `Parameter`) from now on.

    Call `retrack_parameters` afterwards: layers list their variables' old
    parameters until then.
    """
    variable._value = parameter


def own_trainable_variables(layer: Any) -> list[Any]:
    """The trainable variables `layer` created itself (`add_weight`), not
    those of its sublayers (`Layer._trainable_variables`)."""
    return list(layer._trainable_variables)


def own_non_trainable_variables(layer: Any) -> list[Any]:
    """The variables `layer` created itself as non-trainable (statistics such
    as BatchNormalization's moving mean; not a frozen layer's weights), not
    those of its sublayers (`Layer._non_trainable_variables`)."""
    return list(layer._non_trainable_variables)


def reads_cast(layer: Any, variable: Any) -> str | None:
    """The dtype `layer`'s call reads `variable` in when Keras' autocast
    casts it there (a float variable of a layer computing in another float
    dtype, both allowing autocast: `Layer.__call__`'s scope, the variable's
    `_autocast`), else None."""
    compute = layer.compute_dtype
    # `Variable._dtype`: its own dtype (`.dtype` answers the autocast scope's
    # inside a mixed layer's call).
    own = getattr(variable, "_dtype", None)
    if not (
        layer.autocast
        and getattr(variable, "_autocast", False)
        and "float" in str(compute)
        and "float" in str(own)
        and compute != own
    ):
        return None
    return compute


def own_variables(layer: Any) -> list[Any]:
    """Every variable `layer` created itself, trainable or not, not those of
    its sublayers."""
    return [*own_trainable_variables(layer), *own_non_trainable_variables(layer)]


def added_losses(layer: Any) -> list[Any]:
    """The list of the losses `layer.add_loss` collected during its call (not
    its sublayers', not regularizers'): `Layer._losses`, changed in place."""
    return layer._losses


def retrack_parameters(model: Any) -> None:
    """Point each layer's torch parameters (`model.parameters()`, what
    `zero_grad` clears) at its variables' current values. A built Sequential's
    graph (`_functional`, not one of its layers) tracks every variable too:
    left out, it would keep the values replaced (FSDP's whole weights)
    alive."""
    for layer in layers_of(model):
        for tracker in (layer, getattr(layer, "_functional", None)):
            if hasattr(tracker, "_torch_params"):
                tracker._track_variables()


def convert_variables_to_numpy_via(convert: Callable[[Any], Any]) -> Callable:
    """Make `np.asarray(variable)` (`get_weights`, saving) convert each torch
    variable's value with `convert` first, e.g. gather a DTensor; return the
    function that restores Keras' own conversion."""
    cls = torch_core.Variable
    original = cls.__dict__["__array__"]

    def __array__(self: Any, dtype: Any = None) -> Any:
        value = torch_core.convert_to_numpy(convert(self.value))
        return value.astype(dtype) if dtype else value

    cls.__array__ = __array__

    def restore() -> None:
        cls.__array__ = original

    return restore


def read_variables_via(read: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """Make `variable.value` (what every Keras op on a variable reads) return
    `read(variable, value)`, `value` being what Keras would return (its
    storage, autocast when mixed precision says so); return the undo."""
    cls = torch_core.Variable
    original = cls.__dict__["value"]

    def value(self: Any) -> Any:
        return read(self, original.fget(self))

    cls.value = property(value)

    def restore() -> None:
        cls.value = original

    return restore


def assign_variables_via(place: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """Make `variable.assign(value)` write `place(current value, value)`, e.g. a
    plain value laid out like a DTensor variable; return the undo.

    A NumPy value (what `load_weights` and `set_weights` assign) reaches
    `place` as it is: Keras would first copy all of it onto its device."""
    cls = torch_core.Variable
    original = cls.__dict__["_direct_assign"]
    original_convert = cls.__dict__["_convert_to_tensor"]

    # Patched only while a DTensor run is on: DTensor is imported then.
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    def _direct_assign(self: Any, value: Any) -> None:
        placed = place(self.value, value)
        storage = getattr(self, "_value", None)
        if isinstance(getattr(storage, "data", None), DTensor):
            # A variable keras_dist made a DTensor for the run, and `placed`
            # is laid out like it. Keras 3.16 would lay the value out again
            # from the variable's Keras `_layout`, which such a variable has
            # not; 3.15 writes through `value`, which a read may replace.
            with torch.no_grad():
                storage.copy_(placed)
            return
        original(self, placed)

    def _convert_to_tensor(self: Any, value: Any, dtype: Any = None) -> Any:
        current = getattr(self, "_value", None)
        if isinstance(value, np.ndarray) and current is not None:
            placed = place(current, value)
            if placed is not value:
                return placed
        return original_convert(self, value, dtype)

    cls._direct_assign = _direct_assign
    cls._convert_to_tensor = _convert_to_tensor

    def restore() -> None:
        cls._direct_assign = original
        cls._convert_to_tensor = original_convert

    return restore


def _check_variable_storage() -> list[str]:
    missing = []
    variable = keras.Variable([1.0, 2.0])
    if not isinstance(variable, torch_core.Variable):
        missing.append("keras.src.backend.torch.core.Variable")
    elif "__array__" not in torch_core.Variable.__dict__:
        missing.append("keras.src.backend.torch.core.Variable.__array__")
    elif "_direct_assign" not in torch_core.Variable.__dict__:
        missing.append("keras.src.backend.torch.core.Variable._direct_assign")
    elif "_convert_to_tensor" not in torch_core.Variable.__dict__:
        missing.append("keras.src.backend.torch.core.Variable._convert_to_tensor")
    elif not isinstance(torch_core.Variable.__dict__.get("value"), property):
        missing.append("keras.src.backend.torch.core.Variable.value (a property)")
    if not hasattr(variable, "_value"):
        missing.append("Variable._value")
    if not hasattr(torch_core, "convert_to_numpy"):
        missing.append("keras.src.backend.torch.core.convert_to_numpy")
    layer = keras.layers.Dense(1)
    layer.build((None, 2))
    if not hasattr(layer, "_torch_params") or not callable(
        getattr(layer, "_track_variables", None)
    ):
        missing.append("TorchLayer._torch_params / TorchLayer._track_variables")
    return missing
