"""JAX adapter: `jax.sharding` layouts, `jax.distributed` processes."""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import keras
import numpy as np
from jax._src import distributed as jax_distributed
from jax.experimental import layout as jax_layout
from jax.experimental import multihost_utils

from keras_dist.backends.base import BackendAdapter
from keras_dist.backends.jax import (
    compiled_plan,
    host_state,
    input_adapter,
    offload,
    remat,
)
from keras_dist.backends.jax import keras_internals as internals
from keras_dist.backends.jax.input_adapter import (
    DistributedBatches,
    ProcessLocalBatches,
    trim_outputs,
)
from keras_dist.common.accelerators import memory_bytes
from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.prefetch import prefetch_depth
from keras_dist.common.random_streams import take_process_zero_streams
from keras_dist.keras_compat import remat as keras_remat
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.optimizers import is_state_slot, slot_owners

# JAX's sharding-plus-memory-layout object (`Layout` in older releases).
_JaxFormat = getattr(jax_layout, "Format", None) or jax_layout.Layout


def heartbeat_timeout_seconds() -> int:
    raw = os.environ.get("KERAS_DIST_HEARTBEAT_TIMEOUT", "").strip()
    if not raw:
        return 60
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            "KERAS_DIST_HEARTBEAT_TIMEOUT must be a positive whole number of "
            f"seconds. Received: KERAS_DIST_HEARTBEAT_TIMEOUT={raw!r}"
        )
    return int(raw)


def _nothing_to_join(error: Exception) -> bool:
    """Whether `jax.distributed.initialize()` without arguments refused before
    doing anything because no job was asked for: JAX detected no cluster (it
    wants a coordinator address) or already runs as one process."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    message = str(error)
    if isinstance(error, ValueError):
        return "coordinator_address" in message
    return isinstance(error, RuntimeError) and "must be called before" in message


def _device_name(device: Any) -> str:
    return f"{device.platform}:{device.id}"


def _to_jax_device(device: Any) -> Any:
    if isinstance(device, jax.Device):
        return device
    platform, _, index = str(device).partition(":")
    for candidate in jax.devices(platform):
        if candidate.id == int(index or 0):
            return candidate
    raise ValueError(
        f"No JAX device is named {device!r}. Available: "
        f"{[_device_name(d) for d in jax.devices(platform)]}"
    )


class JaxAdapter(BackendAdapter):
    name = "jax"
    # State updates leave the recomputed call as values (`remat.checkpoint`).
    recomputes_layer_state = True
    local_memory_bytes = staticmethod(compiled_plan.local_memory_bytes)

    def simulate_cpu_devices(self, count: int) -> None:
        # Imported here: this method is all of the adapter that needs it.
        from jax._src import xla_bridge  # noqa: PLC0415

        from keras_dist.common import simulated_devices  # noqa: PLC0415

        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError as error:
            started = getattr(xla_bridge, "backends_are_initialized", None)
            if started is not None and not started():
                # Not the runtime having started: say what JAX said.
                raise RuntimeError(
                    f"keras_dist could not simulate {count} CPU devices "
                    f"(KERAS_DIST_CPU_DEVICES={count}) on JAX: {error}"
                ) from error
            present = jax.local_device_count("cpu")
            if present != count:
                raise RuntimeError(
                    simulated_devices.too_late_message(
                        backend="JAX",
                        requested=count,
                        present=present,
                        first_work="JAX computation",
                        examples="jax.numpy, a Keras op, jax.devices()",
                        set_at_start=simulated_devices.set_when_the_process_started(
                            count
                        ),
                    )
                ) from None

    def list_devices(self, device_type: str | None = None) -> list[str]:
        try:
            devices = jax.devices(device_type)
        except RuntimeError:
            if device_type is None:
                raise
            return []  # like torch and TensorFlow: no such devices here
        return [_device_name(device) for device in devices]

    def local_device_count(self, device_type: str | None = None) -> int:
        return jax.local_device_count(device_type)

    def device_memory_bytes(self, device: str) -> int | None:
        platform, _, index = str(device).partition(":")
        try:
            candidates = jax.devices(platform)
        except RuntimeError:
            return None  # no such platform here (a planned, simulated mesh)
        for candidate in candidates:
            if str(candidate.id) == index and candidate.platform != "cpu":
                # memory_stats() is None or lacks the limit on some platforms:
                # then the data sheet's memory of the device's kind.
                stats = candidate.memory_stats() or {}
                limit = stats.get("bytes_limit")
                return int(limit) if limit else memory_bytes(candidate.device_kind)
        return None

    def num_processes(self) -> int:
        return jax.process_count()

    def process_id(self) -> int:
        return jax.process_index()

    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=max(1, int(timeout_seconds)),
                # A lost process is noticed within this time and the others
                # stop with an error instead of waiting in a collective forever.
                heartbeat_timeout_seconds=heartbeat_timeout_seconds(),
            )
        except Exception as error:  # jax raises several XLA runtime types here
            raise RuntimeError(
                f"Process {process_id} of {num_processes} could not join the job "
                f"coordinated at {coordinator_address} within {timeout_seconds:g} "
                f"s: {error}"
            ) from error

    def joined_on_its_own(self) -> tuple[int, int] | None:
        if not jax.distributed.is_initialized():
            return None
        return jax.process_count(), jax.process_index()

    def join_detected_cluster(self, *, timeout_seconds: float) -> bool:
        """`jax.distributed.initialize()` without arguments, as Keras calls it:
        JAX's own detection (Cloud TPU, GKE, Open MPI, `JAX_COORDINATOR_*`...)
        forms the job. With nothing detected JAX raises at once, asking for a
        coordinator address, and this process runs alone; so it does when JAX
        already runs, since `jax.distributed` only joins before the first
        computation (unless `JAX_COORDINATOR_ADDRESS` asks for a job)."""
        if jax.distributed.is_initialized():
            return True
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                initialization_timeout=max(1, int(timeout_seconds)),
                heartbeat_timeout_seconds=heartbeat_timeout_seconds(),
            )
        except Exception as error:  # jax raises several XLA runtime types here
            if not jax.distributed.is_initialized() and _nothing_to_join(error):
                return False
            raise RuntimeError(
                "JAX's cluster detection found a job but this process could not "
                f"join it within {timeout_seconds:g} s (call keras_dist.initialize"
                "() before any JAX computation; to run this process alone, set "
                f"KERAS_DISTRIBUTION_NUM_PROCESSES=1): {error}"
            ) from error
        return True

    def barrier(self, name: str, *, timeout_seconds: float) -> None:
        if jax.process_count() == 1:
            return
        # The coordination service's barrier has a timeout (a collective over
        # the devices, `multihost_utils.sync_global_devices`, has none); its ids
        # are used once and must be equal on every process: a number they all
        # count alike (`name`, which may differ, is for the error only).
        self._barriers = getattr(self, "_barriers", 0) + 1
        client = jax_distributed.global_state.client
        try:
            client.wait_at_barrier(
                f"keras_dist:barrier:{self._barriers}",
                timeout_in_ms=max(1, int(timeout_seconds * 1000)),
            )
        except Exception as error:  # jax raises XLA runtime errors here
            raise self._barrier_timed_out(name, timeout_seconds, error) from error

    def wait_for_process_zero(self, key: str, *, timeout_seconds: float) -> None:
        if jax.process_count() == 1:
            return
        client = jax_distributed.global_state.client
        key = f"keras_dist:{key}"
        try:
            if jax.process_index() == 0:
                client.key_value_set(key, "done", allow_overwrite=True)
            else:
                client.blocking_key_value_get(
                    key, timeout_in_ms=max(1, int(timeout_seconds * 1000))
                )
        except Exception as error:  # jax raises XLA runtime errors here
            raise self._barrier_timed_out(key, timeout_seconds, error) from error

    def gather_numbers(
        self, values: list[float], *, timeout_seconds: float
    ) -> list[list[float]]:
        numbers = [float(value) for value in values]
        if jax.process_count() == 1:
            return [numbers]
        # Through the coordination service's key-value store (it has a
        # timeout, a collective over the devices has none). The keys are
        # numbered alike on every process, as the barriers are.
        self._gathers = getattr(self, "_gathers", 0) + 1
        client = jax_distributed.global_state.client
        keys = [
            f"keras_dist:gather:{self._gathers}:{rank}"
            for rank in range(jax.process_count())
        ]
        timeout_in_ms = max(1, int(timeout_seconds * 1000))
        try:
            client.key_value_set(keys[jax.process_index()], json.dumps(numbers))
            return [
                json.loads(client.blocking_key_value_get(key, timeout_in_ms))
                for key in keys
            ]
        except Exception as error:  # jax raises XLA runtime errors here
            raise self._barrier_timed_out(
                f"gather #{self._gathers}", timeout_seconds, error
            ) from error

    def device_kind(self) -> str | None:
        device = jax.local_devices()[0]
        return "cpu" if device.platform == "cpu" else device.device_kind

    def to_backend_mesh(self, device_mesh: Any) -> Any:
        devices = np.asarray(device_mesh.devices, dtype=object)
        jax_devices = np.array(
            [_to_jax_device(device) for device in devices.reshape(-1)], dtype=object
        ).reshape(devices.shape)
        return jax.sharding.Mesh(jax_devices, tuple(device_mesh.axis_names))

    def to_backend_layout(self, tensor_layout: Any) -> Any:
        mesh = tensor_layout.device_mesh.backend_mesh
        spec = jax.sharding.PartitionSpec(*tensor_layout.axes)
        return jax.sharding.NamedSharding(mesh, spec)

    def is_backend_layout(self, layout: Any) -> bool:
        """A `jax.sharding.Sharding` (`NamedSharding`...) or a
        `jax.experimental.layout.Format`, as Keras' JAX backend accepts."""
        return isinstance(layout, (jax.sharding.Sharding, _JaxFormat))

    def distribute_tensor(self, tensor: Any, tensor_layout: Any) -> Any:
        sharding = tensor_layout
        if not self.is_backend_layout(tensor_layout):
            sharding = tensor_layout.backend_layout
        if isinstance(tensor, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(tensor, sharding)
        host = _host_copy_for_one_local_device(tensor, sharding)
        return jax.device_put(tensor if host is None else host, sharding)

    def state_placement_problem(self, placement: Any) -> str | None:
        return None  # every JAX platform has pinned host memory

    def call_starting(self, model: Any, name: str, distribution: Any) -> Any:
        """Keras builds the optimizer before the call's run starts: each slot
        made where `distribution` keeps it (`building_optimizer`). A plain
        `fit` gets slots an offloaded run left in host memory back on the
        devices first (Keras' own step cannot mix memory kinds)."""
        optimizer = getattr(model, "optimizer", None)
        if distribution is None and name == "fit" and optimizer is not None:
            internals.to_device_memory(optimizer.variables, offload.HOST_MEMORY)
        return self.building_optimizer(model, distribution)

    def building_optimizer(self, model: Any, distribution: Any) -> Any:
        """Each slot made where `distribution` keeps it (`host_state`)."""
        return host_state.slots_in_place(model, distribution, _check_layout_divides)

    def activate(self, model: Any, distribution: Any) -> None:
        input_adapter.forget_last_batch()
        planned = _layouts_for(model, distribution)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            placement = getattr(distribution, "state_placement", None)
            for updating in offload.updating(optimizer):
                offload.check_built_slots(
                    updating, model.trainable_variables, placement
                )
        # Before anything moves: a failed move would leave the model half laid
        # out (its layout set, its value not), and even a plain `fit` broken.
        for variable, layout in planned:
            _check_layout_divides(variable, layout)
        multi_process = jax.process_count() > 1
        if multi_process:
            # Replicas must start equal: process 0's values win, as in DDP.
            # Arrays that already span processes (laid out by an earlier call
            # or a restore) are one global value already.
            local = [
                variable
                for variable, _ in planned
                if getattr(variable.value, "is_fully_addressable", True)
            ]
            values = [np.asarray(variable.value) for variable in local]
            values = multihost_utils.broadcast_one_to_all(values)
            for variable, value in zip(local, values, strict=True):
                variable.assign(value)
        for variable, layout in planned:
            internals.relayout_variable(variable, layout)
        # The user's own steps run as written; an uneven batch reaches them
        # whole (laid out on every device) rather than padded.
        user_steps = bool(internals.user_steps(model))
        if multi_process and not distribution.auto_shard_dataset:
            # Each process reads its own part of the data.
            def batches_for_epoch(batches: Iterator[Any]) -> Iterator[Any]:
                return ProcessLocalBatches(batches, distribution)
        else:
            # Batches made ahead on threads on an accelerator when an
            # execution runs several steps (the steps run while the host
            # slices, pads and places the next ones): `prefetch_depth`.
            platform = _mesh_platform(distribution)
            epochs: weakref.WeakSet[DistributedBatches] = weakref.WeakSet()

            def batches_for_epoch(batches: Iterator[Any]) -> Iterator[Any]:
                epoch = DistributedBatches(
                    batches,
                    distribution,
                    share_random_streams=(
                        self.take_process_zero_streams if multi_process else None
                    ),
                    check_same_input=multi_process,
                    replicate_uneven=user_steps,
                    prefetch=prefetch_depth(platform, _steps_per_execution(model)),
                )
                epochs.add(epoch)
                return epoch

            # No thread making batches outlives the run.
            self._on_deactivate(
                model, lambda: [epoch.close() for epoch in list(epochs)]
            )

        internals.route_batches(batches_for_epoch)
        self._on_deactivate(model, internals.unroute_batches)
        self._install_steps(model, distribution)
        offload.check_updates(model, distribution, self._undo_activation)

    def _install_steps(self, model: Any, distribution: Any) -> None:
        """keras_dist's steps for `model` (the ones `fit`, `evaluate` and
        `predict` run, and the compiled plan compiles), until `deactivate`."""
        internals.install_steps(model, distribution, trim_outputs, jax.value_and_grad)
        self._on_deactivate(model, lambda: internals.remove_steps(model))
        placement = getattr(distribution, "state_placement", None)
        if placement is not None and getattr(model, "optimizer", None) is not None:
            # Each variable's update moves and casts its own slots.
            updating = offload.updating(model.optimizer)
            self._on_deactivate(model, offload.install(updating, placement))
        layers = layers_of(model)
        if getattr(distribution, "remat", None) is not None or any(
            keras_remat.mode_of(layer) is not None for layer in layers
        ):
            # A recomputed layer's Python arguments stay static and its state
            # updates leave `jax.checkpoint` as values (`remat.checkpoint`).
            self._on_deactivate(
                model, keras_remat.recompute_whole_calls(layers, remat.checkpoint)
            )
        # BatchNormalization statistics over the real rows of the global batch;
        # the step's arrays are global already, so nothing needs summing.
        self._normalize_batches(model, GlobalBatchNorm.Replicas())
        self._count_real_rows(model)

    # -- compiled plans ------------------------------------------------------------
    def topology_devices(
        self, platform: str, name: str, count: int, num_slices: int
    ) -> list[Any]:
        return compiled_plan.topology_devices(platform, name, count, num_slices)

    def topology_mesh_devices(
        self,
        devices: list[Any],
        shape: tuple[int, ...],
        num_slices: int,
        slice_axis: int | None = None,
    ) -> Any:
        return compiled_plan.device_mesh_array(devices, shape, num_slices, slice_axis)

    def compile_steps(
        self, model: Any, distribution: Any, data: Any, kinds: tuple[str, ...]
    ) -> dict[str, dict[str, Any]]:
        """Compile keras_dist's `kinds` steps ("train", "test", "predict") of
        `model` under `distribution` on abstract values, `data` being the
        global `(x, y)` batch as shapes and dtypes; the model's variables need
        no values. Returns what XLA says of each step (`CompiledStep`)."""
        state = compiled_plan.state_structs(model, distribution)
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(distribution)
        self._install_steps(model, distribution)
        placement = getattr(distribution, "state_placement", None)
        try:
            steps = {}
            for kind in kinds:
                batch = compiled_plan.batch_structs(
                    distribution, data[:1] if kind == "predict" else data
                )
                with offload.stored_dtypes(model, placement):
                    steps[kind] = compiled_plan.compile_step(model, kind, state, batch)
            return steps
        finally:
            self._undo_activation(model)
            keras.distribution.set_distribution(previous)

    def last_batch_shapes(self) -> Any:
        return input_adapter.last_batch_shapes()

    def deactivate(self, model: Any) -> None:
        self._undo_activation(model)

    def wait_for_steps(self, model: Any) -> None:
        """Block on the state Keras last wrote back into the model (it depends
        on every step dispatched): JAX dispatches asynchronously, and a failed
        step raises only when read (with `verbose=0` nothing reads it)."""
        optimizer = getattr(model, "optimizer", None)
        variables = [
            *model.trainable_variables,
            *model.non_trainable_variables,
            *(optimizer.variables if optimizer is not None else ()),
            *model.metrics_variables,
        ]
        values = [getattr(variable, "value", None) for variable in variables]
        jax.block_until_ready(  # a deleted (donated) value holds nothing
            [v for v in values if isinstance(v, jax.Array) and not v.is_deleted()]
        )

    def take_process_zero_streams(self) -> None:
        """Every process takes process 0's NumPy and Python random generators,
        from which Keras shuffles (a collective)."""
        take_process_zero_streams(
            lambda state: np.asarray(multihost_utils.broadcast_one_to_all(state))
        )


def _steps_per_execution(model: Any) -> int:
    """The steps one execution of `model`'s step function runs (its
    `compile(steps_per_execution=)`), read at each epoch's start."""
    steps = getattr(model, "steps_per_execution", 1)
    return steps if isinstance(steps, int) and steps > 0 else 1


def _mesh_platform(distribution: Any) -> str:
    """The platform ("cpu", "tpu", "gpu") of the devices `distribution`'s mesh
    spans."""
    devices = np.asarray(distribution.device_mesh.backend_mesh.devices)
    return devices.reshape(-1)[0].platform


def _mesh_axes(layout: Any) -> tuple[tuple[Any, ...], dict[str, int]]:
    """`layout`'s axis per dimension and its mesh's size per axis name, for a
    Keras `TensorLayout` or a `jax.sharding.NamedSharding`."""
    if isinstance(layout, jax.sharding.NamedSharding):
        return tuple(layout.spec), dict(layout.mesh.shape)
    mesh = layout.device_mesh
    return tuple(layout.axes), dict(zip(mesh.axis_names, mesh.shape, strict=True))


def _check_layout_divides(variable: Any, layout: Any) -> None:
    """Refuse a layout that splits a dimension of `variable` into unequal
    parts: JAX splits a dimension into equal parts only (PyTorch's DTensor
    splits unevenly; TensorFlow refuses sharded variables altogether)."""
    if layout is None or not isinstance(
        layout, (jax.sharding.NamedSharding, keras.distribution.TensorLayout)
    ):
        return
    axes, sizes = _mesh_axes(layout)
    shape = tuple(variable.shape)
    for dimension, (size, axis) in enumerate(zip(shape, axes, strict=False)):
        names = (axis,) if isinstance(axis, str) else tuple(axis or ())
        parts = int(np.prod([sizes.get(name, 1) for name in names]))
        if parts <= 1 or size % parts == 0:
            continue
        spelled = " x ".join(
            f"{name!r} ({sizes.get(name, 1)} devices)" for name in names
        )
        raise ValueError(
            f"Variable {variable.path!r} of shape {shape} cannot be laid out as "
            f"{axes}: its dimension {dimension} has size {size}, which mesh axis "
            f"{spelled} does not divide into equal parts, as JAX requires. Fix: "
            f"give dimension {dimension} `None` in the LayoutMap (replicated), "
            f"make its size a multiple of {parts} (e.g. {size + (-size) % parts}), "
            f"or use a mesh whose axis {names[0]!r} has a size that divides {size}. "
            "The model was left as it was."
        )


def _layouts_for(model: Any, distribution: Any) -> list[tuple[Any, Any]]:
    """Every variable of `model` and its optimizer, with the layout it gets
    (optimizer slots: the layout of the variable they mirror)."""
    planned: dict[int, tuple[Any, Any]] = {}
    for variable in [*model.variables, *model.metrics_variables]:
        if id(variable) not in planned:
            planned[id(variable)] = (
                variable,
                distribution.layout_for_variable(variable),
            )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        # Unbuilt, it still has its step counter (and learning rate): laid out
        # too, or Keras' jit sees local and mesh variables mixed.
        owners = slot_owners(optimizer, model.trainable_variables)
        placement = getattr(distribution, "state_placement", None)
        for variable in optimizer.variables:
            owner = owners.get(id(variable))
            if owner is not None:
                layout = planned[id(owner)][1]
                if is_state_slot(variable):
                    layout = offload.slot_layout(placement, layout)
            else:
                layout = distribution.layout_for_variable(variable)
            planned[id(variable)] = (variable, layout)
    return list(planned.values())


def _gathered(value: Any) -> np.ndarray | None:
    """The whole of `value` on this process if it is split across processes
    (a collective: every process reads it, as every process saves), else None
    (JAX reads it locally)."""
    if (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    ):
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return None


def _host_copy_for_one_local_device(tensor: Any, layout: Any) -> np.ndarray | None:
    """`tensor` as a NumPy array when JAX's `device_put` would lay it out
    wrongly on `layout`, else None (`device_put` takes it as it is).

    A jax.Array held whole on this process and not committed to a device
    (what `ops.zeros`, `jnp.asarray` and a plain variable's value are) put on
    a sharding that spans processes with one device on this process (one
    device a process, e.g. one GPU each) and laid out as the array is (a
    replicated layout): JAX (0.10) reuses the array as the one local shard of
    the global array, a shard that claims every device of the sharding. Such
    an array trains, but its shards cannot be read (`np.asarray`,
    `get_weights`, a metric's `result()`, Orbax: "the input arrays must have
    one shard each"). From NumPy, JAX builds the local shard on the local
    device and checks, as for the array, that every process gave the same
    value."""
    if isinstance(layout, keras.distribution.TensorLayout):
        layout = layout.backend_layout
    if (
        isinstance(tensor, jax.Array)
        and not isinstance(tensor, jax.core.Tracer)
        and isinstance(layout, jax.sharding.Sharding)
        and not layout.is_fully_addressable
        and len(layout.addressable_devices) == 1
        and tensor.is_fully_addressable
        and not tensor.committed
    ):
        return np.asarray(tensor)
    return None


def _placed_exactly(tensor: Any, layout: Any) -> Any:
    """What Keras' `distribute_tensor` should lay out for `tensor` on `layout`:
    `tensor` itself when it is on `layout` already (Keras then returns it as
    it is, skipping its own equivalence check); a NumPy copy where
    `device_put` would lay it out wrongly (see
    `_host_copy_for_one_local_device`); under a keras_dist distribution, a
    concrete array whose sharding is merely *equivalent* to `layout` put on
    `layout` itself; else None (`tensor` as it is).

    Keras keeps an array whose sharding is equivalent to the layout as it is:
    on a one-device mesh every array on that device is, so a variable (or a
    metric reset to zeros at an epoch's start) keeps an uncommitted
    single-device array while the step's outputs come back on the mesh. JAX
    keys its compiled functions on each argument's sharding and mesh, so the
    train, test and predict steps were traced and compiled again: on the
    second step, at every epoch's start and after `evaluate` (two or three
    compilations of each step where one is enough). With every value of the
    state on exactly its layout, the step's state goes in and comes out with
    the same shardings and each step function compiles once per input
    signature. Placing an array on a sharding of the devices it is on already
    copies nothing."""
    if isinstance(layout, keras.distribution.TensorLayout):
        layout = layout.backend_layout
    concrete = isinstance(tensor, jax.Array) and not isinstance(tensor, jax.core.Tracer)
    if concrete:
        sharding = tensor.sharding
        if sharding is layout or (
            type(sharding) is type(layout) and sharding == layout
        ):
            # Placed already (a step's output written back into its variable
            # at every epoch's end): as it is, with no further checks.
            return tensor
    host = _host_copy_for_one_local_device(tensor, layout)
    if host is not None:
        return host
    if (
        concrete
        and isinstance(layout, jax.sharding.NamedSharding)
        and getattr(keras.distribution.distribution(), "lays_out_batches_itself", False)
    ):
        return jax.device_put(tensor, layout)
    return None


def _built_shard_by_shard(variable: Any, value: Any, layout: Any) -> Any:
    """A NumPy `value` assigned to a variable laid out on a sharding, as the
    laid-out array built from the host, each device receiving only its part
    (the part of each device of this process), else None (Keras' own way).

    Keras' `assign` copies the whole value onto one device before laying it
    out (keras#21712), so loading a model larger than one device would fail
    there. The host keeps the whole value, as the file read gave it."""
    if not isinstance(value, np.ndarray):
        return None  # already an array (a training step's, Orbax's...)
    if isinstance(layout, keras.distribution.TensorLayout):
        layout = layout.backend_layout
    if not isinstance(layout, jax.sharding.Sharding) or tuple(value.shape) != tuple(
        variable.shape
    ):
        return None  # Keras converts it, and names a wrong shape
    dtype = jax.numpy.dtype(variable.dtype)
    return jax.make_array_from_callback(
        value.shape,
        layout,
        # np.array keeps a 0-d value 0-d (ascontiguousarray makes it 1-d).
        lambda index: np.array(value[index], dtype=dtype, order="C"),
    )


internals.install_batch_routing()
# Variables made under keras_dist's policies are made split (never whole on one
# device first).
internals.split_variables_at_creation(
    lambda distribution: getattr(distribution, "lays_out_variables_itself", False)
)
internals.read_variables_through(_gathered)
internals.place_tensors_through(_placed_exactly)
internals.assign_host_values_through(_built_shard_by_shard)
# A slot kept in host memory is made there (never on the device first).
internals.make_variables_through(host_state.made_in_host_memory)
ADAPTER = JaxAdapter()
