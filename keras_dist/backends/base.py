"""The small interface every backend adapter implements.

The backend-neutral core (meshes, layouts, policies, runtime, callback, trainer)
talks to the active Keras backend only through this interface, so it never
imports jax, torch or tensorflow and never branches on the backend name.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.row_aware import (
    average_gradients_in,
    inject_loss_weights,
    optimizers_of,
)
from keras_dist.keras_compat.batch_norm import replace_moments
from keras_dist.keras_compat.metrics import install_row_aware_metrics


class BackendAdapter(abc.ABC):
    """What keras_dist needs from one Keras backend.

    Methods that an adapter cannot honour yet raise `NotImplementedError` with a
    message that says what is missing; they never silently do nothing.
    """

    #: The Keras backend name this adapter serves (`keras.backend.backend()`).
    name: str = ""
    #: Whether Keras' train step reads each batch in Python, with `next()` on
    #: the epoch's iterator, where keras_dist can time the read
    #: (`keras_dist.callbacks.Throughput`); TensorFlow reads inside the step.
    reads_batches_in_python: bool = True
    #: Whether a layer whose call updates state (a seed generator's, moving
    #: statistics) is recomputed exactly by activation checkpointing (`remat=`):
    #: its updates made once and its random numbers the same in the recomputed
    #: call. Where not, `remat` leaves such layers out (and says so).
    recomputes_layer_state: bool = False

    def __init__(self) -> None:
        # id(model) -> what undoes its activation, in the order it was done.
        self._undo: dict[int, list[Callable[[], None]]] = {}

    def _on_deactivate(self, model: Any, undo: Callable[[], None]) -> None:
        """Have `deactivate(model)` call `undo` (last registered, first run)."""
        self._undo.setdefault(id(model), []).append(undo)

    def _undo_activation(self, model: Any) -> None:
        for undo in reversed(self._undo.pop(id(model), [])):
            undo()

    def _normalize_batches(self, model: Any, replicas: Any) -> None:
        """BatchNormalization over the real rows of the batch across `replicas`
        (a `GlobalBatchNorm.Replicas`) until `deactivate(model)`."""
        moments = functools.partial(GlobalBatchNorm.moments, replicas)
        # The layer's whole normalization too, where the backend has one op
        # for it (torch); elsewhere Keras' own `call` around the moments.
        normalize = None
        if replicas.normalize is not None:
            normalize = functools.partial(GlobalBatchNorm.normalize, replicas)
        self._on_deactivate(model, replace_moments(model, moments, normalize))

    def _count_real_rows(self, model: Any) -> None:
        """Keras' loss trackers and compiled metrics, and `model.compute_loss`
        called without weights, leave a padded batch's padding rows out inside
        keras_dist's steps (and the user's own), until `deactivate(model)`."""
        install_row_aware_metrics()
        self._on_deactivate(model, inject_loss_weights(model))

    def _average_gradients(self, model: Any) -> None:
        """Every optimizer of `model` averages its gradients over the replicas
        inside a user's own step (`StepRows.average_gradients`), until
        `deactivate(model)`."""
        self._on_deactivate(model, average_gradients_in(optimizers_of(model)))

    # -- devices and processes -------------------------------------------------
    @abc.abstractmethod
    def simulate_cpu_devices(self, count: int) -> None:
        """Make `count` CPU devices visible to this process.

        Called once at import when `KERAS_DIST_CPU_DEVICES` is set, before the
        backend runtime starts.
        """

    @abc.abstractmethod
    def list_devices(self, device_type: str | None = None) -> list[str]:
        """Global device names such as `"cpu:0"`, accelerators first."""

    @abc.abstractmethod
    def local_device_count(self, device_type: str | None = None) -> int:
        """Devices that belong to this process."""

    def device_memory_bytes(self, device: str) -> int | None:
        """The memory, in bytes, that `device` (a name such as `"gpu:0"`)
        offers to tensors, or None when the backend does not say (CPU
        devices, TensorFlow). Reads device properties only; allocates nothing.
        """
        return None

    @abc.abstractmethod
    def num_processes(self) -> int:
        """Processes in the job (1 when not initialized)."""

    @abc.abstractmethod
    def process_id(self) -> int:
        """This process' rank (0 when not initialized)."""

    @abc.abstractmethod
    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        """Join the multi-process job whose coordinator is `coordinator_address`."""

    def barrier(self, name: str, *, timeout_seconds: float) -> None:
        """Return once every process of the job has called `barrier(name)`.

        Every process calls the same barriers in the same order; `name` tells
        them apart in errors. Raises `RuntimeError` naming this process when the
        others do not all arrive within `timeout_seconds`. One process: returns.
        """
        if self.num_processes() > 1:
            raise NotImplementedError(
                f"The {self.name} adapter cannot wait for the other processes "
                f"(barrier {name!r})."
            )

    def wait_for_process_zero(self, key: str, *, timeout_seconds: float) -> None:
        """Process 0 announces that it reached `key` and goes on at once; the
        others return once it has (`RuntimeError` naming this process after
        `timeout_seconds`). Process 0 never waits, so it may reach a key the
        others never do. Each key is announced once: callers number them.
        By default a `barrier`, which waits on process 0 too."""
        self.barrier(key, timeout_seconds=timeout_seconds)

    def gather_numbers(
        self, values: list[float], *, timeout_seconds: float
    ) -> list[list[float]]:
        """Every process' `values` (as many on each), in rank order.

        Every process calls it at the same point of the run (a collective,
        numbered by the order of calls). Raises `RuntimeError` naming this
        process when the others do not all arrive within `timeout_seconds`.
        One process: `[values]`.
        """
        if self.num_processes() > 1:
            raise NotImplementedError(
                f"The {self.name} adapter cannot gather numbers from the other "
                "processes."
            )
        return [[float(value) for value in values]]

    def device_kind(self) -> str | None:
        """What this process' first device is, as the engine names it
        ("NVIDIA H100 80GB HBM3", "TPU v4"), "cpu" for a CPU, or None when
        the backend does not say."""
        return None

    def random_stream(self) -> Any:
        """The backend's own global random generator that Keras shuffles
        with (a `keras_dist.random_streams.BackendStream`), or None when Keras
        shuffles with NumPy's and Python's only (JAX, TensorFlow)."""
        return None

    def data_random_stream(self) -> Any:
        """A generator of keras_dist's own that shuffles the data of the active
        run (a `BackendStream`; read and set only right before an epoch's
        data iterator is made), or None."""
        return None

    def collective_trace(self) -> str | None:
        """A readable account of this process' latest collectives (which one
        it waits in), for the hang doctor; None when the backend keeps none
        (JAX and TensorFlow)."""
        return None

    def _barrier_timed_out(
        self, name: str, timeout_seconds: float, error: BaseException
    ) -> RuntimeError:
        return RuntimeError(
            f"Process {self.process_id()} of {self.num_processes()} waited "
            f"{timeout_seconds:g} s at {name!r} for the other processes, which "
            "did not all get there (one failed, hangs, is slower than that, or "
            f"skipped the call: make it on every process): {error}"
        )

    # -- layouts ---------------------------------------------------------------
    @abc.abstractmethod
    def to_backend_mesh(self, device_mesh: Any) -> Any:
        """The backend's own mesh object for a `DeviceMesh`."""

    @abc.abstractmethod
    def to_backend_layout(self, tensor_layout: Any) -> Any:
        """The backend's own sharding object for a `TensorLayout`."""

    @abc.abstractmethod
    def distribute_tensor(self, tensor: Any, tensor_layout: Any) -> Any:
        """Lay `tensor` out as `tensor_layout` says (eagerly or inside a trace).

        `tensor_layout` is a `TensorLayout` with a mesh, or a layout object of
        the backend's own for which `is_backend_layout` is true.
        """

    def unsupported_split(self, layer: Any, variable: Any, axes: tuple) -> str | None:
        """Why this backend cannot train `layer` (None when unknown) with its
        `variable` laid out as `axes` (a mesh axis name or None per dimension),
        or None when it can. `keras_dist.layouts` replicates such variables
        instead. None (no known limit) by default."""
        return None

    def is_backend_layout(self, layout: Any) -> bool:
        """Whether `distribute_tensor` takes `layout`, an object of the
        backend's own (what `TensorLayout.backend_layout` gives), as it is.
        None by default."""
        return False

    def joined_on_its_own(self) -> tuple[int, int] | None:
        """`(process count, rank)` of the job the backend joined without
        keras_dist (the script called `jax.distributed.initialize()` before
        `initialize()`), or None (the default). Never starts the backend."""
        return None

    def join_detected_cluster(self, *, timeout_seconds: float) -> bool:
        """Join the job the backend's own cluster detection finds, if any.

        Called by `initialize()` when neither arguments, `KERAS_DISTRIBUTION_*`
        nor keras_dist's cluster detection configured a job. Returns whether a
        job was joined; `False` (the default) means none was detected and the
        process runs alone. Raises `RuntimeError` when one was detected but
        could not be joined.
        """
        return False

    # -- compiled plans ---------------------------------------------------------
    def _no_compiled_plan(self) -> NotImplementedError:
        return NotImplementedError(
            f"A plan compiled for a topology needs the JAX backend (XLA compiles "
            f"for devices this machine does not have); on {self.name} the plan "
            "is the static one: call keras_dist.plan without topology=, or run "
            "it with KERAS_BACKEND=jax."
        )

    def topology_devices(
        self, platform: str, name: str, count: int, num_slices: int
    ) -> list[Any]:
        """The devices of a TPU topology (`name` as libtpu spells it, e.g.
        "v5e:16x16"), `count` CPU devices, or (`platform="local"`) every
        device of this job, for a compiled plan."""
        raise self._no_compiled_plan()

    def local_memory_bytes(self) -> int | None:
        """What a program may allocate on the least of this process'
        devices, as the engine reports it, or None where it reports none
        (CPU devices)."""
        return None

    def topology_mesh_devices(
        self,
        devices: list[Any],
        shape: tuple[int, ...],
        num_slices: int,
        slice_axis: int | None = None,
    ) -> Any:
        """`devices` as an array of the mesh's `shape`, laid out along the
        topology's links; with several slices, axis `slice_axis` (default:
        the first the slice count divides) spans them."""
        raise self._no_compiled_plan()

    def last_batch_shapes(self) -> Any:
        """The shapes and dtypes of the last global batch a run laid out in
        this process (the batch's structure, before padding), or None when
        the backend does not record it (the plan of a call that ran out of
        memory compiles its step at that batch)."""
        return None

    def compile_steps(
        self, model: Any, distribution: Any, data: Any, kinds: tuple[str, ...]
    ) -> dict[str, dict[str, Any]]:
        """Compile `model`'s steps under `distribution` on abstract values and
        say what the compiler says of each (`keras_dist.planner` reads it)."""
        raise self._no_compiled_plan()

    # -- training --------------------------------------------------------------
    @abc.abstractmethod
    def activate(self, model: Any, distribution: Any) -> None:
        """Prepare `model` to run `fit`/`evaluate`/`predict` under `distribution`.

        Lays out the variables that already exist, routes the model's input
        batches through keras_dist (sharding, padding and masking) and drops any
        compiled step that was built for another layout. The distribution is
        already the global one when this is called.
        """

    def state_placement_problem(self, placement: Any) -> str | None:
        """Why this backend cannot keep the optimizer's state as `placement`
        (a `StatePlacement`: `offload=`, `optimizer_state_dtype=`) says, or
        None when it can. Only JAX can."""
        asked = [
            f"{name}={value!r}"
            for name, value in (
                ("offload", placement.offload),
                ("optimizer_state_dtype", placement.optimizer_state_dtype),
            )
            if value is not None
        ]
        why = {
            "torch": " (keras_dist's PyTorch FSDP shards through DTensor, not "
            "FSDP2's `fully_shard`, so FSDP2's `CPUOffloadPolicy` does not "
            "apply, and DDP has no offload)",
        }.get(self.name, "")
        return (
            f"{', '.join(asked)} is implemented on the JAX backend only, not on "
            f"{self.name}{why}. Run with KERAS_BACKEND=jax, or leave "
            "`offload` and `optimizer_state_dtype` at None."
        )

    def call_starting(self, model: Any, name: str, distribution: Any) -> Any:
        """A context manager around a whole Keras call `name` (`"fit"`,
        `"evaluate"`, `"predict"`) on `model`, `distribution` being the one a
        `DistributeCallback` among its callbacks holds (None without one):
        entered before Keras builds anything for the call (the optimizer's
        slots included), left after the call's run ended. Nothing by
        default."""
        return contextlib.nullcontext()

    def building_optimizer(self, model: Any, distribution: Any) -> Any:
        """A context manager around building `model`'s optimizer outside a
        call (a restore into a model that never trained), `distribution`
        being the global one: its slots are made where `distribution` keeps
        them, as a call's are (`call_starting`). Nothing by default."""
        return contextlib.nullcontext()

    def wait_for_steps(self, model: Any) -> None:
        """Return once every step dispatched for `model` has run; a step that
        failed on a device raises its engine's error here. Called at the end
        of each epoch and of each distributed call, never per step. PyTorch
        and TensorFlow raise a step's error from the step itself (their steps
        run before the call that dispatched them returns): nothing to wait
        for by default."""
        return None

    def scope(self, distribution: Any) -> Any:
        """A context manager entered by `distribution.scope()`, after the
        distribution became the global one. Nothing more by default."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def deactivate(self, model: Any) -> None:
        """Undo what `activate` changed on `model`; the variables keep their layout."""
