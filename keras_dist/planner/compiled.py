"""The compiled plan: `fit`'s own steps compiled for a topology, and the
roofline that projects their time.

The backend compiles (`BackendAdapter.compile_steps`: JAX only); this module
makes the model without values, the mesh on the topology's devices and the
distribution on it, checks what can be checked before anything compiles,
and turns what XLA says into a `CompiledPlan`.

Roofline, per device and step (figures from `common.accelerators`):

    compute       flops / peak FLOP/s of the chip in the compute dtype
    memory        (arguments read + outputs written) / HBM bandwidth: what
                  must cross HBM at least once (XLA's bytes accessed counts
                  every operation's operands as if unfused: not a bound)
    host          the larger of the bytes moved to the device from pinned
                  host memory and back / the chip's host bandwidth (PCIe is
                  full duplex: the two directions overlap)
    interconnect  (2 x all-reduce + all-gather + reduce-scatter + all-to-all
                   + collective-permute bytes) / ICI bandwidth
    network       with several slices: the cross-slice bytes (what each chip
                  sends over the data-center network: a ring's count of each
                  transfer XLA hands it) / the chip's share of the
                  data-center network. The batch axis spans the slices where
                  the slice count divides it (the gradients' reduction
                  crosses them once a step, as MaxText's
                  `dcn_data_parallelism`); else another axis does, with a
                  warning
    step_seconds  the longest of the five (they overlap at best): a lower
                  bound of the step
    mfu           compute / step_seconds
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.common import accelerators
from keras_dist.distribution.layer_settings import apply_layer_settings
from keras_dist.keras_compat.abstract_models import (
    abstract_variables,
    build_for_training,
)
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.planner.model import input_specs, input_structure, made_model
from keras_dist.planner.paper_mesh import check_mesh, distribution_on_mesh
from keras_dist.planner.result import CompiledPlan, CompiledStep, Plan
from keras_dist.planner.topology import (
    LOCAL,
    Topology,
    known_slices,
    parse_topology,
)

STEP_KINDS = ("train", "test", "predict")
#: `CompiledStep.collective_bytes`' key for what crosses slices.
CROSS_SLICE = "cross-slice"


class TopologyMesh:
    """The devices of a topology and meshes made on them."""

    def __init__(self, topology: Topology):
        self.topology = topology
        adapter = get_adapter()
        try:
            self.devices = adapter.topology_devices(
                topology.platform,
                topology.libtpu_name,
                topology.chips,
                topology.num_slices,
            )
        except ValueError as error:
            if topology.platform != "tpu":
                raise
            generation = topology.libtpu_name.partition(":")[0]
            raise ValueError(f"{error} {known_slices(generation)}") from error
        first = self.devices[0]
        self.device_kind = (
            "cpu" if first.platform == "cpu" else str(getattr(first, "device_kind", ""))
        )
        self.platform = str(first.platform)

    @property
    def local(self) -> bool:
        """Whether these are this job's own devices (`topology="local"`)."""
        return self.topology.platform == LOCAL

    def describe(self) -> str:
        """The devices in words, one spelling per set of devices: for
        `"local"` their count, kind and processes, else the topology."""
        if not self.local:
            parsed = self.topology
            return parsed.libtpu_name or f"{parsed.platform}:{parsed.chips}"
        processes = get_adapter().num_processes()
        return (
            f"local:{len(self.devices)}x{self.device_kind}"
            f":{processes}process{'es' if processes > 1 else ''}"
        )

    def distribution(self, distribution: Any, mesh: Mapping[str, int] | None) -> Any:
        """`distribution` (a function of the mesh) on a mesh of `mesh`'s shape
        (default: every device on the one axis the function's own mesh
        would name) made of the topology's devices."""
        if isinstance(distribution, KerasDistribution):
            raise TypeError(
                "With topology=, `distribution` must be a function of the "
                "DeviceMesh returning the distribution (keras_dist.FSDP, "
                "keras_dist.DataParallel, or lambda mesh: keras_dist.ModelParallel"
                "(...)): the mesh is made on the topology's devices. Received: "
                f"distribution={distribution!r}"
            )
        if not callable(distribution):
            raise TypeError(
                "`distribution` must be a function of the DeviceMesh. Received: "
                f"distribution={distribution!r}"
            )
        sizes = dict(mesh) if mesh is not None else {"batch": len(self.devices)}
        if math.prod(sizes.values()) != len(self.devices):
            raise ValueError(
                f"The mesh {sizes} has {math.prod(sizes.values())} devices; the "
                f"topology {self.topology.name!r} has {len(self.devices)}. Give a "
                "mesh whose sizes multiply to the topology's device count."
            )
        adapter = get_adapter()
        shape = tuple(sizes.values())
        slices = self.topology.num_slices
        array = adapter.topology_mesh_devices(self.devices, shape, slices)
        made, _ = distribution_on_mesh(distribution, sizes, devices=array)
        if slices == 1:
            return made
        names = list(sizes)
        batch = getattr(made, "batch_dim_name", None)
        spanning = slice_axes(made)
        if batch in names and sizes[batch] % slices == 0 and spanning != [batch]:
            # The batch axis spans the slices: the gradients' reduction
            # crosses them once a step, not a model axis' every layer.
            array = adapter.topology_mesh_devices(
                self.devices, shape, slices, names.index(batch)
            )
            made, _ = distribution_on_mesh(distribution, sizes, devices=array)
        elif spanning and batch not in spanning:
            sequence = getattr(made, "sequence_axis", None)
            kinds = ", ".join(
                f"{axis!r}: "
                + (
                    "the keys and values of each attention layer"
                    if axis == sequence
                    else "the activations of each layer"
                )
                for axis in spanning
            )
            why = (
                f"the batch axis {batch!r} (size {sizes[batch]}) is not a multiple "
                f"of {slices}"
                if batch in names
                else f"the mesh has no batch axis {batch!r}"
            )
            warnings.warn(
                f"With {slices} slices, the mesh axis {', '.join(spanning)!r} "
                f"spans them: {why}, so the collectives along it ({kinds}) cross "
                "the data-center network every step. Give the batch axis a size "
                f"that {slices} divides. Received: mesh={sizes}, "
                f"num_slices={slices}",
                UserWarning,
                stacklevel=4,
            )
        return made

    def memory(self) -> int | None:
        if self.local:
            # What the engine lets a program allocate (CPUs: None).
            return get_adapter().local_memory_bytes()
        return accelerators.memory_bytes(self.device_kind)


def slice_axes(distribution: Any) -> list[str]:
    """The axes of `distribution`'s mesh along which its devices change
    slice (the data-center network): `[]` on one slice."""
    mesh = distribution.device_mesh
    devices = np.asarray(mesh.devices, dtype=object)
    slices = np.vectorize(lambda device: getattr(device, "slice_index", 0) or 0)(
        devices
    )
    return [
        name
        for index, name in enumerate(mesh.axis_names)
        if devices.shape[index] > 1 and np.any(np.diff(slices, axis=index) != 0)
    ]


def check_topology_arguments(topology: Any, num_slices: Any, mesh: Any) -> Topology:
    """The topology, read before any engine is asked (bad names, slices)."""
    parsed = parse_topology(topology, num_slices)
    if mesh is not None:
        count = math.prod(int(size) for size in dict(mesh).values())
        devices = parsed.chips * parsed.num_slices
        if parsed.platform == "tpu" and count != devices and count * 2 != devices:
            # (v4 and v5p compile-only topologies may list a device per core.)
            raise ValueError(
                f"The mesh {dict(mesh)} has {count} devices; the topology "
                f"{parsed.name!r} has {devices} chips. Give a mesh whose sizes "
                "multiply to the topology's device count."
            )
        if parsed.platform == "cpu" and count != devices:  # "local": when made
            raise ValueError(
                f"The mesh {dict(mesh)} has {count} devices; the topology "
                f"{parsed.name!r} has {devices}."
            )
    return parsed


def abstract_model(model: Any, input_shape: Any) -> Any:
    """`model` itself, or the model a function makes, made (and compiled, if
    the function compiles it) and built without allocating its variables."""
    with abstract_variables():
        return made_model(model, input_shape)


class UntrainableModelError(ValueError):
    """The train or test step is to be compiled, and the model is not
    compiled (`missing="compile"`) or has no loss (`missing="loss"`).

    The message speaks Python; the command (`keras-dist plan`) says it in
    its own words from the attributes.

    Attributes:
        model_name: the model's name.
        steps: the steps that need the loss and optimizer (`"train"`, `"test"`).
        missing: `"compile"` or `"loss"`.
    """

    def __init__(self, model: Any, steps: list[str], missing: str):
        self.model_name = model.name
        self.steps = steps
        self.missing = missing
        needs = " and ".join(steps)
        if missing == "compile":
            message = (
                f"The compiled plan of the {needs} step needs a compiled model "
                "(its loss and optimizer are part of the step): call "
                "model.compile(optimizer=..., loss=...) in the model function, "
                "or plan only prediction with steps=('predict',). Received: "
                f"model {model.name!r}, not compiled."
            )
        else:
            message = (
                f"The compiled plan of the {needs} step needs a loss: model "
                f"{model.name!r} was compiled without one. Give "
                "model.compile(loss=...)."
            )
        super().__init__(message)


def check_trainable(model: Any, kinds: tuple[str, ...]) -> None:
    """Refuse, before compiling, a model whose train or test step cannot run
    (`UntrainableModelError`)."""
    needs_loss = [kind for kind in kinds if kind in ("train", "test")]
    if not needs_loss:
        return
    if getattr(model, "optimizer", None) is None or not getattr(
        model, "compiled", False
    ):
        raise UntrainableModelError(model, needs_loss, "compile")
    if getattr(model, "loss", None) is None and not _overrides_loss(model):
        raise UntrainableModelError(model, needs_loss, "loss")


def _overrides_loss(model: Any) -> bool:
    return any(
        name in type(model).__dict__
        for name in ("compute_loss", "train_step", "compute_loss_and_updates")
    ) or any(
        "compute_loss" in klass.__dict__
        for klass in type(model).__mro__
        if not klass.__module__.startswith("keras.")
    )


def batch_data(
    model: Any,
    batch_size: int,
    input_shape: Any,
    sequence_length: int | None,
    target_shape: Any,
) -> tuple[Any, Any]:
    """The global batch `(x, y)` as `keras.KerasTensor`s of `batch_size`
    rows: x from the model's inputs (or `input_shape` / `sequence_length`),
    y as the compiled loss expects it (`target_shape` says it otherwise)."""
    specs = input_specs(model, input_shape, sequence_length)
    if specs is None:
        specs = input_structure(model)
    if specs is None:
        raise ValueError(
            "The compiled plan needs the model's input shapes: the model is "
            "subclassed; pass input_shape=."
        )

    def with_rows(tensor: Any) -> Any:
        shape = tuple(tensor.shape)[1:]
        if any(size is None for size in shape):
            raise ValueError(
                f"An input of the model has unknown dimensions {tuple(tensor.shape)}"
                " (e.g. a sequence length): pass input_shape= (or "
                "sequence_length= for a KerasHub model's (batch, sequence) inputs)."
            )
        return keras.KerasTensor((batch_size, *shape), dtype=tensor.dtype)

    x = keras.tree.map_structure(with_rows, specs)
    with abstract_variables():
        outputs = keras.tree.flatten(model.compute_output_spec(x))
    losses = keras.tree.flatten(getattr(model, "loss", None) or [None])
    if target_shape is not None:
        y = keras.KerasTensor(
            (batch_size, *tuple(target_shape)), dtype=_target_dtype(losses[0])
        )
        return x, y
    targets = []
    for index, output in enumerate(outputs):
        loss = losses[index] if index < len(losses) else losses[-1]
        shape = tuple(output.shape)
        if _is_sparse(loss):
            targets.append(keras.KerasTensor(shape[:-1], dtype="int32"))
        else:
            targets.append(keras.KerasTensor(shape, dtype="float32"))
    return x, targets[0] if len(targets) == 1 else tuple(targets)


def _is_sparse(loss: Any) -> bool:
    name = loss if isinstance(loss, str) else type(loss).__name__
    name = getattr(loss, "name", None) or name
    return "sparse" in str(name).lower() or "Sparse" in type(loss).__name__


def _target_dtype(loss: Any) -> str:
    return "int32" if _is_sparse(loss) else "float32"


def compiled_plan(
    model: Any,
    made: Any,
    topology_mesh: TopologyMesh,
    *,
    batch_size: int,
    input_shape: Any,
    sequence_length: int | None,
    target_shape: Any,
    kinds: tuple[str, ...],
    device_memory: int | None,
) -> CompiledPlan:
    """Compile `kinds` steps of `model` (made by `abstract_model`) under the
    distribution `made` on the topology's mesh."""
    topology = topology_mesh.topology
    x, y = batch_data(model, batch_size, input_shape, sequence_length, target_shape)
    if getattr(model, "compiled", False):
        with abstract_variables():
            build_for_training(model, (x, y))
    adapter = get_adapter()
    # What a run under `made` gives the model's layers (`training.session`).
    undo = apply_layer_settings(
        model,
        made,
        warn=False,
        recomputes_state=getattr(adapter, "recomputes_layer_state", False),
    )
    try:
        raw = adapter.compile_steps(model, made, (x, y), kinds)
        compute_dtype = keras.backend.standardize_dtype(
            model.dtype_policy.compute_dtype
        )
    finally:
        undo()
    memory = device_memory or topology_mesh.memory()
    kind = accelerators.kind_of(topology_mesh.device_kind)
    steps = {
        name: _projected(figures, kind, compute_dtype, topology.num_slices)
        for name, figures in raw.items()
    }
    notes = [
        "Figures per device. XLA's: peak bytes (arguments + outputs + "
        "temporaries + code - aliased) on the device and in the host's pinned "
        "memory, flops, the collectives and the host transfers of the "
        "compiled program. Projected: step time and MFU, from a roofline over "
        "the chip's peak FLOP/s and bandwidths (keras_dist.common.accelerators):"
        " the longest of compute, memory (arguments read and outputs written "
        "once), host transfers, interconnect and network time, a lower bound."
    ]
    if kind is None or kind.peak_16 is None:
        notes.append(
            f"No step time is projected: keras_dist's table has no peak for "
            f"{topology_mesh.device_kind!r}."
        )
    moving = [
        step
        for step in steps.values()
        if step.host_to_device_bytes or step.device_to_host_bytes
    ]
    if moving and kind is not None and kind.host_bandwidth is None:
        notes.append(
            "The step moves data between the host and the devices, but "
            f"keras_dist's table has no host bandwidth for "
            f"{topology_mesh.device_kind!r}: the projection leaves that time out."
        )
    if memory is None:
        notes.append(
            "The devices' memory is unknown: pass device_memory= to know whether "
            "it fits."
        )
    elif device_memory is None and topology_mesh.local:
        notes.append("Each device's memory: the limit the engine reports for it.")
    elif device_memory is None and (
        source := accelerators.memory_source(topology_mesh.device_kind)
    ):
        notes.append(f"Each device's memory: {source}.")
    return CompiledPlan(
        topology.name,
        topology_mesh.device_kind,
        len(topology_mesh.devices),
        topology.num_slices,
        compute_dtype,
        steps,
        memory,
        notes,
        ", ".join(slice_axes(made)) or None,
    )


def _projected(
    figures: dict[str, Any], kind: Any, compute_dtype: str, num_slices: int
) -> CompiledStep:
    step = CompiledStep(**figures)
    if step.error or kind is None or step.flops is None:
        return step
    peak = kind.peak_16 if compute_dtype in ("bfloat16", "float16") else kind.peak_32
    moved = step.collective_bytes
    ici = 2 * moved.get("all-reduce", 0) + sum(
        size for name, size in moved.items() if name not in ("all-reduce", CROSS_SLICE)
    )
    seconds: dict[str, float | None] = {
        "compute": step.flops / peak if peak else None,
        "memory": (
            step.device_traffic_bytes / kind.memory_bandwidth
            if kind.memory_bandwidth and step.device_traffic_bytes is not None
            else None
        ),
        "host": _host_seconds(step, kind),
        "interconnect": (
            ici / kind.interconnect_bandwidth if kind.interconnect_bandwidth else None
        )
        if ici
        else 0.0,
        "network": 0.0,
    }
    if num_slices > 1:
        seconds["network"] = (
            moved.get(CROSS_SLICE, 0) / kind.network_bandwidth
            if kind.network_bandwidth
            else None
        )
    known = [value for value in seconds.values() if value is not None]
    step_seconds = max(known) if known and seconds["compute"] is not None else None
    mfu = (
        seconds["compute"] / step_seconds
        if step_seconds and seconds["compute"] is not None
        else None
    )
    return dataclasses.replace(
        step, seconds=seconds, step_seconds=step_seconds, mfu=mfu
    )


def _host_seconds(step: CompiledStep, kind: Any) -> float | None:
    """The host term: 0 without transfers, None where the chip's host
    bandwidth is not in the table."""
    moved = max(step.host_to_device_bytes or 0, step.device_to_host_bytes or 0)
    if not moved:
        return 0.0
    return moved / kind.host_bandwidth if kind.host_bandwidth else None


def plan_on_topology(
    static_plan: Callable[[Any, Any, int | None, int | None], Plan],
    model: Any,
    distribution: Any,
    topology: Any,
    num_slices: Any,
    *,
    mesh: Any,
    input_shape: Any,
    sequence_length: Any,
    batch_size: Any,
    device_memory: Any,
    target_shape: Any,
    steps: Any,
) -> Plan:
    """The static plan (`static_plan(model, distribution, batch_size,
    memory)`) and the compiled one, on a topology's devices. Every argument
    is checked, the topology resolved, the model made and its layouts
    planned before anything compiles."""
    parsed = check_topology_arguments(topology, num_slices, mesh)
    if mesh is not None:
        check_mesh(mesh)
    kinds = tuple(steps) if isinstance(steps, (tuple, list)) else (steps,)
    if not kinds or any(kind not in STEP_KINDS for kind in kinds):
        raise ValueError(
            f"`steps` must name some of {STEP_KINDS}. Received: steps={steps!r}"
        )
    for name, value in (("batch_size", batch_size), ("device_memory", device_memory)):
        if value is None and name == "device_memory":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"A plan compiled for a topology needs `{name}` as a positive "
                f"int (batch_size: the global batch). Received: {name}={value!r}"
            )
    adapter = get_adapter()
    if adapter.name != "jax":
        raise NotImplementedError(
            f"A plan compiled for a topology needs the JAX backend; on "
            f"{adapter.name} the plan is the static one: call keras_dist.plan "
            "without topology= (with mesh= for the shape of the mesh), or run "
            "with KERAS_BACKEND=jax."
        )
    on_topology = TopologyMesh(parsed)
    made = on_topology.distribution(distribution, mesh)
    model = abstract_model(model, input_shape)
    check_trainable(model, kinds)
    memory = device_memory or on_topology.memory()
    result = static_plan(model, made, batch_size, memory)
    result.compiled = compiled_plan(
        model,
        made,
        on_topology,
        batch_size=batch_size,
        input_shape=input_shape,
        sequence_length=sequence_length,
        target_shape=target_shape,
        kinds=kinds,
        device_memory=device_memory,
    )
    result.made_distribution = made
    return result


__all__ = [
    "STEP_KINDS",
    "TopologyMesh",
    "UntrainableModelError",
    "abstract_model",
    "check_topology_arguments",
    "check_trainable",
    "compiled_plan",
    "plan_on_topology",
]
