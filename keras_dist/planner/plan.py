"""`keras_dist.plan`: where every variable goes and what each device holds,
from shapes only, before anything is allocated on a device."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.distribution.layout_map import LayoutMap, bind_layout_map
from keras_dist.distribution.swapped_axes import model_width, swapped_dimensions
from keras_dist.keras_compat.distribution import KerasDistribution
from keras_dist.keras_compat.optimizers import is_state_slot
from keras_dist.planner.compiled import STEP_KINDS, plan_on_topology
from keras_dist.planner.model import (
    check_input_shape,
    input_specs,
    input_structure,
    made_model,
    output_paths,
    output_tensors,
    traced_outputs,
    unbuilt_layers,
    unique_variables,
)
from keras_dist.planner.paper_mesh import check_mesh, distribution_on_mesh
from keras_dist.planner.result import DeviceTotals, Plan, Problem, VariableRow
from keras_dist.planner.slots import Slot, optimizer_slots
from keras_dist.runtime import api as runtime

__all__ = ["DeviceTotals", "Plan", "Problem", "VariableRow", "plan"]

UNMATCHED = "unmatched"
ON_INDIVISIBLE = ("error", "replicate")
ACTIVATION_NOTE = (
    "Activations are an estimate: the sum of the output sizes of the model's "
    "inputs and top-level layers for one batch of `batch_size` rows, split "
    "along the batch axis. It leaves out what layers keep inside (attention "
    "scores, nested models' inner outputs) and the compiler's workspace, and "
    "counts every output as alive at once. Gradients are counted apart: one per "
    "trainable variable, in its dtype and layout."
)

SEQUENCE_NOTE = (
    " With sequence_axis={axis!r}, inputs and outputs whose second dimension "
    "is the inputs' sequence length ([batch, sequence, ...]) are split along "
    "it too; inside each attention layer a "
    "device holds its rows of the scores ([batch, heads, sequence / N, "
    "sequence]) and the keys and values of the whole sequence, which this "
    "estimate leaves out: the compiled plan (topology=) counts them."
)


@dataclass(frozen=True)
class _Shape:
    """What a distribution reads of a variable: path, shape, dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def plan(
    model: Any,
    distribution: Any,
    *,
    mesh: Mapping[str, int] | None = None,
    input_shape: Any = None,
    sequence_length: int | None = None,
    batch_size: int | None = None,
    device_memory: int | None = None,
    on_indivisible: str = "error",
    optimizer: Any = None,
    topology: str | None = None,
    num_slices: int = 1,
    target_shape: Any = None,
    steps: tuple[str, ...] = STEP_KINDS,
) -> Plan:
    """Lay out `model` under `distribution` on paper: every variable's layout
    and bytes per device, each device's totals, and every problem found.

    Only variable paths, shapes and dtypes are read; no value is read and
    nothing is placed on a device, so a mesh of devices this machine does not
    have can be planned: give its shape as `mesh=` (or name placeholder
    devices in a `DeviceMesh`: `devices=[f"gpu:{i}" for i in range(64)]`).

    Args:
        model: a Keras model, or a function of no arguments returning one: it
            is then made and built inside `keras.StatelessScope`, where Keras
            defers variable initialisation, so even a model far larger than
            this machine's memory is planned without allocating it. A model
            that is not built (a `Sequential` without `keras.Input`, a
            subclassed model never called) is built from `input_shape`, or
            refused: a plan never counts what it did not see. (A model
            object, rather than a function, is built for real.)
        distribution: a `DataParallel`, `ModelParallel` or `FSDP` (keras_dist's
            or Keras' own policies); with `mesh=`, a function of the
            `DeviceMesh` returning one, such as `keras_dist.FSDP` itself or
            `lambda mesh: keras_dist.ModelParallel(layout_map=...)`.
        mesh: `{axis name: size}`, e.g. `{"batch": 8, "model": 8}`, for a
            `distribution` given as a function: the mesh is made on this
            machine's devices when it has enough, else on placeholder names
            (`"gpu:0"`... after this machine's device type), whose memory is
            unknown unless `device_memory` says it.
        input_shape: the shape of one sample, without the batch dimension, as
            `keras.Input(shape=...)` takes it (a dict of them by input name,
            or a list, for several inputs). Builds a model that is not built,
            and sizes the activation estimate of a functional model whose
            inputs have unknown dimensions (e.g. a sequence length).
        sequence_length: for a built model whose inputs have an unknown
            dimension 1 (KerasHub backbones' `(batch, sequence)` token ids
            and padding mask): that dimension's size for the activation
            estimate. Give `input_shape` or `sequence_length`, not both.
        batch_size: the global batch, for the activation estimate (functional
            and Sequential models only).
        device_memory: bytes per device. Defaults to what the backend reports
            (`memory_stats()["bytes_limit"]` on JAX accelerators, the CUDA
            total on PyTorch); unknown on CPU and TensorFlow.
        on_indivisible: `"error"` raises a `ValueError` for a dimension that
            its mesh axis does not divide; `"replicate"` plans that dimension
            replicated and reports it as a problem.
        optimizer: an optimizer (or its name, e.g. `"adam"`) whose slots to
            count. Defaults to the model's compiled optimizer, if any.
            Slots are counted by building a copy of it on the model's
            trainable variables inside the same stateless scope.
        topology: compile `fit`'s own steps for this topology (JAX only) and
            add what XLA says of them as `plan.compiled`: a TPU slice by
            name (`"v5e:2x2"`, `"v5e-256"`, `"v5p:4x4x8"`, `"v6e-8"`; needs
            `libtpu`: `pip install "keras-dist[tpu]"`), `"cpu:N"` (N CPU
            devices of this process) or `"local"` (the devices this job has:
            every process' GPUs, TPU chips or CPUs; their memory as the
            engine reports it, none for CPUs). `distribution` is then a function of
            the mesh made on the topology's devices, of `mesh=`'s shape or,
            without it, every device on one axis `"batch"`; `batch_size` is
            needed. A model function may compile its model (the step needs
            its loss and optimizer); its variables are never allocated.
        num_slices: TPU slices joined by the data-center network; the
            distribution's batch axis spans them where the count divides it
            (else the first axis it divides, with a warning), and what
            crosses them is counted as `"cross-slice"` collective bytes.
        target_shape: one sample's target shape for the compiled step, when
            it is not the model's output shape (or that shape without its
            last dimension, for a sparse loss).
        steps: which of `"train"`, `"test"` and `"predict"` to compile.

    Returns:
        A `Plan`.

    Example:

    >>> mesh = keras_dist.DeviceMesh((1,), ["batch"], ["cpu:0"])
    >>> def build():
    ...     return keras.Sequential(
    ...         [keras.Input((4,)), keras.layers.Dense(2, name="dense")], name="net"
    ...     )
    >>> result = keras_dist.plan(build, keras_dist.DataParallel(mesh), batch_size=8)
    >>> [(row.path, row.bytes_per_device) for row in result.rows]
    [('net/dense/kernel', 32), ('net/dense/bias', 8)]
    >>> result.devices[0].activations  # inputs and outputs of 8 rows, float32
    192
    >>> wide = keras_dist.plan(build, keras_dist.FSDP, mesh={"batch": 64})
    >>> len(wide.devices)  # placeholder devices: this machine need not have 64
    64
    """
    if topology is not None:
        _check_sequence_length(input_shape, sequence_length)
        return plan_on_topology(
            _static_plan(on_indivisible, optimizer, input_shape, sequence_length),
            model,
            distribution,
            topology,
            num_slices,
            mesh=mesh,
            input_shape=input_shape,
            sequence_length=sequence_length,
            batch_size=batch_size,
            device_memory=device_memory,
            target_shape=target_shape,
            steps=steps,
        )
    _check_arguments(distribution, mesh, batch_size, device_memory, on_indivisible)
    check_input_shape(input_shape)
    _check_sequence_length(input_shape, sequence_length)
    model = made_model(model, input_shape)
    placeholders = False
    if mesh is not None:
        distribution, placeholders = distribution_on_mesh(distribution, mesh)
    specs = input_specs(model, input_shape, sequence_length)
    slots, slot_note = optimizer_slots(model, optimizer)
    planner = _Planner(model, distribution, on_indivisible, placeholders)
    result = planner.run(slots, slot_note, batch_size, device_memory, specs)
    if get_adapter().name != "jax":
        result.notes.append(
            f"This plan is the static one (shapes and estimates): on "
            f"{get_adapter().name} no step is compiled for it. With "
            "KERAS_BACKEND=jax, topology= compiles fit's own step and reads "
            "XLA's memory and cost."
        )
    return result


def _static_plan(
    on_indivisible: str, optimizer: Any, input_shape: Any, sequence_length: Any
) -> Callable[[Any, Any, int | None, int | None], Plan]:
    """The static plan of a made model and distribution, for the compiled
    plan (`plan_on_topology`) to run before it compiles."""
    if on_indivisible not in ON_INDIVISIBLE:
        raise ValueError(
            f"`on_indivisible` must be one of {ON_INDIVISIBLE}. Received: "
            f"on_indivisible={on_indivisible!r}"
        )
    check_input_shape(input_shape)

    def static(
        model: Any, distribution: Any, batch_size: int | None, memory: int | None
    ) -> Plan:
        specs = input_specs(model, input_shape, sequence_length)
        slots, slot_note = optimizer_slots(model, optimizer)
        planner = _Planner(model, distribution, on_indivisible, False)
        return planner.run(slots, slot_note, batch_size, memory, specs)

    return static


def _check_arguments(
    distribution: Any,
    mesh: Any,
    batch_size: Any,
    device_memory: Any,
    on_indivisible: Any,
) -> None:
    if mesh is None and not isinstance(distribution, KerasDistribution):
        more = (
            " A function of the mesh needs the mesh's shape as mesh=, e.g. "
            "mesh={'batch': 8}."
            if callable(distribution)
            else ""
        )
        raise TypeError(
            "`distribution` must be a DataParallel, ModelParallel or FSDP."
            f"{more} Received: distribution={distribution!r}"
        )
    if mesh is not None:
        if isinstance(distribution, KerasDistribution) or not callable(distribution):
            raise TypeError(
                "With mesh=, `distribution` must be a function of the DeviceMesh "
                "returning the distribution (such as keras_dist.FSDP, or lambda "
                "mesh: keras_dist.ModelParallel(layout_map=...)); a distribution "
                "has its own mesh already. Received: "
                f"distribution={distribution!r}, mesh={mesh!r}"
            )
        check_mesh(mesh)
    for name, value in (("batch_size", batch_size), ("device_memory", device_memory)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"`{name}` must be an int or None. Received: {name}={value!r}"
            )
        if value < 1:
            raise ValueError(f"`{name}` must be at least 1. Received: {name}={value}")
    if on_indivisible not in ON_INDIVISIBLE:
        raise ValueError(
            f"`on_indivisible` must be one of {ON_INDIVISIBLE}. Received: "
            f"on_indivisible={on_indivisible!r}"
        )


def _check_sequence_length(input_shape: Any, sequence_length: Any) -> None:
    if sequence_length is None:
        return
    if isinstance(sequence_length, bool) or not isinstance(
        sequence_length, (int, np.integer)
    ):
        raise TypeError(
            "`sequence_length` must be an int or None. Received: "
            f"sequence_length={sequence_length!r}"
        )
    if sequence_length < 1:
        raise ValueError(
            f"`sequence_length` must be at least 1. Received: "
            f"sequence_length={sequence_length}"
        )
    if input_shape is not None:
        raise ValueError(
            "Give `input_shape` or `sequence_length`, not both: the input shape "
            f"says the sequence length already. Received: input_shape="
            f"{input_shape!r}, sequence_length={sequence_length}"
        )


def _itemsize_bits(dtype: Any) -> int:
    name = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(name).itemsize * 8
    except TypeError:  # bfloat16, float8_*, int4: not NumPy dtypes
        bits = re.search(r"(\d+)", name)
        return int(bits.group(1)) if bits else 32


def _device_name(device: Any) -> str:
    if hasattr(device, "platform") and hasattr(device, "id"):
        return f"{device.platform}:{device.id}"
    return str(device)


class _Planner:
    def __init__(
        self, model: Any, distribution: Any, on_indivisible: str, placeholders: bool
    ):
        self.model = model
        self.distribution = distribution
        self.on_indivisible = on_indivisible
        self.placeholders = placeholders
        mesh = distribution.device_mesh
        self.mesh = {
            str(a): int(s) for a, s in zip(mesh.axis_names, mesh.shape, strict=True)
        }
        self.batch_axis = getattr(distribution, "batch_dim_name", None) or next(
            iter(self.mesh)
        )
        self.sequence_axis = getattr(distribution, "sequence_axis", None)
        # keras_dist's ModelParallel and FSDP say `layout_map`; Keras' own
        # ModelParallel keeps it as `_layout_map` only.
        self.layout_map = getattr(distribution, "layout_map", None)
        if self.layout_map is None:
            self.layout_map = getattr(distribution, "_layout_map", None)
        self.keys = list(self.layout_map) if self.layout_map is not None else []
        # A preset map (keras_dist.layouts) looks `model`'s paths up in the
        # model's own numbering of its automatically named layers.
        bind_layout_map(distribution, model)
        self.lookup_path = (
            self.layout_map.lookup_path
            if isinstance(self.layout_map, LayoutMap)
            else lambda path: path
        )
        self.problems: list[Problem] = []
        self.indivisible: list[str] = []

    def run(
        self,
        slots: list[Slot],
        slot_note: str,
        batch_size: int | None,
        device_memory: int | None,
        specs: Any,
    ) -> Plan:
        self._check_built()
        variables = unique_variables(self.model.variables)
        trainable = {id(v) for v in self.model.trainable_variables}
        model_rows: list[VariableRow] = []
        by_path: dict[str, VariableRow] = {}
        map_axes: dict[str, tuple] = {}
        for variable in variables:
            spec = _Shape(
                variable.path,
                tuple(int(s) for s in variable.shape),
                str(variable.dtype),
            )
            role = "trainable" if id(variable) in trainable else "non-trainable"
            row, map_axes[spec.path] = self._row(spec, role)
            model_rows.append(row)
            by_path.setdefault(row.path, row)
        slot_rows = []
        placement = getattr(self.distribution, "state_placement", None)
        for slot in slots:
            spec = _Shape(slot.path, slot.shape, slot.dtype)
            owner = by_path.get(slot.owner) if slot.owner else None
            if owner is not None and placement is not None and is_state_slot(slot.path):
                # Stored as `optimizer_state_dtype=` says, where `offload=` says.
                spec = _Shape(slot.path, slot.shape, placement.slot_dtype(slot.dtype))
                row = self._sized(spec, "optimizer", owner.key, owner.axes)
                slot_rows.append(replace(row, memory=placement.slot_memory))
            elif owner is not None:
                slot_rows.append(self._sized(spec, "optimizer", owner.key, owner.axes))
            else:
                slot_rows.append(self._row(spec, "optimizer")[0])
        if self.indivisible:
            raise ValueError(
                "Some dimensions do not divide the mesh axis they are split "
                "along:\n  " + "\n  ".join(self.indivisible) + "\nFix the LayoutMap "
                "(lay that dimension out along another axis or None), change the "
                "mesh, or pass on_indivisible='replicate' to plan them replicated."
            )
        self._check_keys(model_rows)
        self._check_swapped(model_rows, map_axes)
        activations, activation_note = self._activations(batch_size, specs)
        devices = self._devices(model_rows, slot_rows, activations, device_memory)
        notes = [slot_note, activation_note]
        if self.placeholders:
            notes.append(
                f"The mesh's {len(devices)} devices are placeholder names (this "
                f"machine has {runtime.get_device_count()}): nothing runs on them, "
                "and their memory is what device_memory= says."
            )
        if all(d.memory is None for d in devices):
            notes.append(
                "Device memory is unknown (CPU or a backend that does not report "
                "it): pass device_memory= to check that the plan fits."
            )
        return Plan(
            repr(self.distribution),
            self.mesh,
            self.batch_axis,
            model_rows + slot_rows,
            devices,
            self.problems,
            notes,
        )

    def _check_built(self) -> None:
        unbuilt = unbuilt_layers(self.model)
        if unbuilt:
            self.problems.append(
                Problem(
                    "unbuilt",
                    f"{len(unbuilt)} layer(s) of the model are not built, so "
                    "their variables, if they have any, are not in this plan: "
                    f"{unbuilt[:8]}{' ...' if len(unbuilt) > 8 else ''}. A layer "
                    "the model never calls is never built: call it, build it "
                    "(layer.build(shape)) or remove it.",
                    tuple(unbuilt),
                )
            )

    # -- one variable ------------------------------------------------------------
    def _matching_keys(self, path: str) -> list[str]:
        path = self.lookup_path(path)
        if path in self.keys:
            return [path]
        return [key for key in self.keys if re.search(key, path)]

    def _row(self, spec: _Shape, role: str) -> tuple[VariableRow, tuple]:
        """The variable's row and the axes its LayoutMap key gives it."""
        keys = self._matching_keys(spec.path)
        lookup = spec
        if len(keys) > 1:
            self.problems.append(
                Problem(
                    "multiple-keys",
                    f"{spec.path!r} matches {len(keys)} LayoutMap keys {keys}; Keras "
                    f"raises on it. The plan uses the first, {keys[0]!r}. Make the "
                    "keys specific enough that each path matches one.",
                    (spec.path,),
                )
            )
        if keys:
            # An exact key wins over regex matches: looking the key itself up
            # gives that key's layout, whatever else matches the path.
            lookup = _Shape(keys[0], spec.shape, spec.dtype)
            map_layout = tuple(self.layout_map[keys[0]].axes)
        else:
            map_layout = ()
        rank = len(spec.shape)
        if len(map_layout) > rank:
            self.problems.append(
                Problem(
                    "too-many-axes",
                    f"LayoutMap key {keys[0]!r} gives {spec.path!r} (shape "
                    f"{spec.shape}) {len(map_layout)} axes {map_layout}; keras_dist "
                    "raises on it when training starts. Give at most one axis or "
                    "None per dimension. Planned replicated.",
                    (spec.path,),
                )
            )
            axes = self._fsdp((None,) * rank, spec)
            map_layout = (None,) * rank
        else:
            layout = self.distribution.get_variable_layout(lookup)
            axes = tuple(layout.axes) + (None,) * (rank - len(layout.axes))
        axes = self._divisible(spec, axes, keys[0] if keys else UNMATCHED)
        map_axes = map_layout + (None,) * (rank - len(map_layout))
        return self._sized(spec, role, keys[0] if keys else UNMATCHED, axes), map_axes

    def _fsdp(self, axes: tuple, spec: _Shape) -> tuple:
        """`axes` with FSDP's splits added as `FSDP.layout_for_variable`
        adds them: its axis, then its sequence axis, each on a dimension of
        its own."""
        fsdp_dimension = getattr(self.distribution, "fsdp_dimension", None)
        if fsdp_dimension is None:
            return axes
        sequence_axis = getattr(self.distribution, "sequence_axis", None)
        for axis in filter(None, (self.distribution.axis, sequence_axis)):
            dimension = fsdp_dimension(spec.path, spec.shape, spec.dtype, axes, axis)
            if dimension is not None:
                axes = axes[:dimension] + (axis,) + axes[dimension + 1 :]
        return axes

    def _divisible(self, spec: _Shape, axes: tuple, key: str) -> tuple:
        kept = list(axes)
        for dimension, axis in enumerate(axes):
            if axis is None or spec.shape[dimension] % self.mesh[axis] == 0:
                continue
            what = (
                f"{spec.path!r}: dimension {dimension} (size "
                f"{spec.shape[dimension]}, shape {spec.shape}) does not divide mesh "
                f"axis {axis!r} (size {self.mesh[axis]}); LayoutMap key {key!r}"
            )
            if self.on_indivisible == "error":
                self.indivisible.append(what)
                continue
            kept[dimension] = None
            self.problems.append(
                Problem(
                    "indivisible",
                    f"{what}. Planned replicated along {axis!r}; the distribution "
                    "itself refuses it until the LayoutMap says so.",
                    (spec.path,),
                )
            )
        return tuple(kept)

    def _sized(self, spec: _Shape, role: str, key: str, axes: tuple) -> VariableRow:
        elements = int(np.prod(spec.shape, dtype=np.int64))
        total = elements * _itemsize_bits(spec.dtype) // 8
        parts = int(
            np.prod([self.mesh[a] for a in axes if a is not None], dtype=np.int64)
        )
        per_device = -(-total // parts)
        return VariableRow(
            spec.path, spec.shape, spec.dtype, role, key, axes, total, per_device
        )

    # -- the whole map -----------------------------------------------------------
    def _check_keys(self, rows: list[VariableRow]) -> None:
        paths = [row.path for row in rows] + output_paths(self.model)
        paths = [self.lookup_path(path) for path in paths]
        for key in self.keys:
            matched = [p for p in paths if key == p or re.search(key, p)]
            if not matched:
                self.problems.append(
                    Problem(
                        "unmatched-key",
                        f"LayoutMap key {key!r} matches no variable or layer output of "
                        "the model (a typo, or a key for another model): what it "
                        "should shard stays replicated.",
                        (key,),
                    )
                )
                continue
            names = sorted(
                {p.rsplit("/", 1)[-1] for p in matched if not p.endswith("/output")}
            )
            if len(names) > 1:
                self.problems.append(
                    Problem(
                        "mixed-roles",
                        f"LayoutMap key {key!r} matches variables of different roles "
                        f"{names} (e.g. a kernel and its LoRA factors, which need "
                        "other layouts); anchor the key, e.g. end it with '/kernel$'.",
                        tuple(matched),
                    )
                )

    def _check_swapped(
        self, rows: list[VariableRow], map_axes: dict[str, tuple]
    ) -> None:
        width = model_width(self.model, [(row.path, row.shape) for row in rows])
        for row in rows:
            axes = map_axes.get(row.path, ())
            if swapped_dimensions(row.shape, axes, width, self.batch_axis) is None:
                continue
            self.problems.append(
                Problem(
                    "swapped-axes",
                    f"{row.path!r} (shape {row.shape}) has layout {axes}: a model "
                    f"axis on its model-width dimension (size {width}) and the "
                    f"data axis {self.batch_axis!r} on another; the two look "
                    "swapped (as in KerasHub's Llama and Qwen maps, keras-hub#2827, "
                    "which keras_dist.layouts.for_keras_hub repairs). Check the "
                    f"LayoutMap key {row.key!r}.",
                    (row.path,),
                )
            )

    # -- totals ------------------------------------------------------------------
    def _activations(
        self, batch_size: int | None, specs: Any
    ) -> tuple[int | None, str]:
        if batch_size is None:
            return None, "No activation estimate: pass batch_size= for one."
        tensors, unknown = output_tensors(self.model)
        if tensors is None:
            return None, (
                "No activation estimate: the model is subclassed, so its layers' "
                "outputs are unknown before it runs."
            )
        given = keras.tree.flatten(specs) if specs is not None else []
        own = keras.tree.flatten(input_structure(self.model))
        if given and [t.shape for t in given] != [t.shape for t in own]:
            # The graph runs again on the given shapes, each call counted.
            try:
                tensors, unknown = given + traced_outputs(self.model, specs), []
            except Exception as error:  # whatever a layer raises on those shapes
                return None, (
                    "No activation estimate: running the model's graph on inputs "
                    f"of shapes {[tuple(t.shape) for t in given]} failed "
                    f"({type(error).__name__}: {error})."
                )
        lengths = set()
        if self.sequence_axis is not None:
            parts = self.mesh[self.sequence_axis]
            lengths = {
                int(t.shape[1])
                for t in (given or own)
                if len(t.shape) >= 2 and t.shape[1] and t.shape[1] > 1
            }
            lengths = {length for length in lengths if length % parts == 0}
        total = 0
        for tensor in tensors:
            shape = tuple(tensor.shape)[1:]
            if any(size is None for size in shape):
                return None, (
                    f"No activation estimate: an output has unknown dimensions "
                    f"{tuple(tensor.shape)} (e.g. a sequence length); pass "
                    "input_shape= (or sequence_length= for a KerasHub backbone's "
                    "(batch, sequence) inputs)."
                )
            elements = batch_size * int(np.prod(shape, dtype=np.int64))
            size = elements * _itemsize_bits(tensor.dtype) // 8
            if shape and shape[0] in lengths:
                # [batch, sequence, ...]: split along the sequence axis too, as
                # `sequence.data_axes` lays the inputs out and they stay.
                size = -(-size // self.mesh[self.sequence_axis])
            total += size
        note = ACTIVATION_NOTE
        if self.sequence_axis is not None:
            note += SEQUENCE_NOTE.format(axis=self.sequence_axis)
        if unknown:
            note += f" Layers called more than once are left out: {unknown}."
        return -(-total // self.mesh[self.batch_axis]), note

    def _devices(
        self,
        model_rows: list[VariableRow],
        slot_rows: list[VariableRow],
        activations: int | None,
        device_memory: int | None,
    ) -> list[DeviceTotals]:
        # Every layout splits evenly, so every device holds the same bytes.
        parameters = sum(row.bytes_per_device for row in model_rows)
        gradients = sum(
            row.bytes_per_device for row in model_rows if row.role == "trainable"
        )
        slots = sum(r.bytes_per_device for r in slot_rows if r.memory == "device")
        host = sum(r.bytes_per_device for r in slot_rows if r.memory != "device")
        names = [
            _device_name(d)
            for d in np.asarray(self.distribution.device_mesh.devices).reshape(-1)
        ]
        devices = []
        for name in names:
            memory = device_memory
            if memory is None and not self.placeholders:
                memory = get_adapter().device_memory_bytes(name)
            devices.append(
                DeviceTotals(
                    name, parameters, slots, activations, memory, gradients, host
                )
            )
        over = [d for d in devices if d.memory is not None and d.total > d.memory]
        if over:
            largest = sorted(model_rows + slot_rows, key=lambda r: -r.bytes_per_device)
            self.problems.append(
                Problem(
                    "out-of-memory",
                    f"{len(over)} device(s) ({', '.join(d.device for d in over[:4])}"
                    f"{', ...' if len(over) > 4 else ''}) need {over[0].total:,} bytes "
                    f"(parameters {parameters:,}, gradients {gradients:,}, optimizer "
                    f"slots {slots:,}, activations {activations or 0:,}) but have "
                    f"{over[0].memory:,}, {over[0].total - over[0].memory:,} short. "
                    "Shard more (FSDP, a model axis), use more devices or a smaller "
                    "batch.",
                    tuple(row.path for row in largest[:5]),
                )
            )
        return devices
