"""Compile `fit`'s own steps for devices this machine need not have.

A TPU topology (`"v5e:16x16"`, two slices of `"v5p:4x4x4"`) is described by
`libtpu` on any host (`jax.experimental.topologies`): its devices can be put
in a mesh and compiled for, not run on. `"cpu:N"` is N CPU devices of this
process; `"local"` every device of this job (`jax.devices()`: each
process' GPUs, TPU chips or CPUs), which can be run on too. The steps
compiled are the ones Keras' `make_*_function` jits for the model with
keras_dist's steps installed, lowered on abstract values
(`jax.ShapeDtypeStruct`s carrying the variables' and the batch's shardings):
nothing is allocated. What XLA says of the compiled program is read here:

    memory_analysis()   arguments + outputs + temporaries + code - aliased,
                        on the device and in its host's memory (pinned_host)
    cost_analysis()     flops, bytes accessed (per device)
    as_text()           every collective, its kind and its bytes per device;
                        with several slices, what crosses them: each slice
                        runs its own program, whose collectives stay in the
                        slice, and XLA hands what crosses slices to the
                        megascale runtime as `send`/`recv` pairs marked
                        `_xla_megascale_transfer_type` (the gradients'
                        all-reduce: a reduce-scatter in the slice, the
                        shard's all-reduce across slices, an all-gather)
                        and the transfers between the device and pinned_host
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import time
from typing import Any

import jax
import numpy as np

from keras_dist.backends.jax import keras_internals as internals
from keras_dist.backends.jax.offload import slot_layout
from keras_dist.common import tpu_host
from keras_dist.common.padding import MaskedBatch, padded_size
from keras_dist.keras_compat.optimizers import is_state_slot, slot_owners

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)
# HLO element types and their bits.
_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_CHANNEL = re.compile(r"channel_id=(\d+)")
#: `collectives()`' key for what crosses slices (the data-center network).
CROSS_SLICE = "cross-slice"
_MEGASCALE_SEND = re.compile(r"=\s*(?P<type>\(.+?\))\s+send\(")
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')
_TRANSFER = re.compile(r'_xla_megascale_transfer_type="([A-Z_]*)"')
# An instruction, its result type and its first operand (`%x = T op(%y, ...`).
_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>[a-z][a-z0-9-]*)\((?P<operands>[^)]*)\)"
)
# Memory space 5 in a layout (`{1,0:T(8,128)S(5)}`): the host's pinned memory.
_HOST_SPACE = "S(5)"
_ENTRY_LAYOUT = "entry_computation_layout={"
# The chips of one TPU host along each axis of a slice, as libtpu assumes.
_HOST_CHIPS = (2, 2, 1)


# -- devices -------------------------------------------------------------------
def libtpu_problem() -> str | None:
    """Why TPU topologies cannot be compiled for here (libtpu missing or not
    the version this JAX pairs with), or None."""
    wanted = [
        requirement.split(";")[0].strip()
        for requirement in importlib.metadata.requires("jax") or []
        if requirement.startswith("libtpu") and 'extra == "tpu"' in requirement
    ]
    pin = wanted[0] if wanted else "libtpu"
    install = f'pip install "keras-dist[tpu]" (or "jax[tpu]=={jax.__version__}")'
    try:
        found = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return (
            f"Compiling for a TPU topology needs libtpu ({pin}, the version jax "
            f"{jax.__version__} pairs with), which is not installed: {install}"
        )
    if wanted and "==" in pin:
        version = pin.split("==", 1)[1].strip()
        prefix = version.rstrip("*").rstrip(".")
        if not (found == version or found.startswith(prefix + ".") or found == prefix):
            return (
                f"libtpu {found} is installed, but jax {jax.__version__} pairs "
                f"with {pin}: {install}"
            )
    return None


def topology_devices(platform: str, name: str, count: int, num_slices: int) -> list:
    """The devices of a TPU topology (`platform="tpu"`, `name` as libtpu
    spells it, e.g. "v5e:16x16"), `count` CPU devices of this process, or
    (`platform="local"`) every device of this job, all processes'."""
    if platform == "local":
        return list(jax.devices())
    if platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise ValueError(
                f"topology='cpu:{count}' needs {count} CPU devices in this "
                f"process; it has {len(devices)}. Set KERAS_DIST_CPU_DEVICES="
                f"{count} before the process starts (or XLA_FLAGS="
                f"--xla_force_host_platform_device_count={count})."
            )
        return list(devices[:count])
    problem = libtpu_problem()
    if problem is not None:
        raise RuntimeError(problem + ".")
    # libtpu asks a cloud metadata server about the host otherwise.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # A compile-only client holds no chip: several processes may describe
    # topologies at once (plan_search's workers, two plans side by side)
    # instead of the second failing on libtpu's one-process lock file. Where
    # a chip is attached, JAX has opened it before this runs.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # noqa: PLC0415

    options: dict[str, Any] = {"num_slices": num_slices} if num_slices > 1 else {}
    # libtpu lays a slice out on hosts of 2x2 chips unless told otherwise: a
    # slice smaller than one host (a single v5e chip, "v5e:1x1") is one host
    # of its own size.
    grid = [int(size) for size in name.partition(":")[2].split("x") if size]
    grid += [1] * (3 - len(grid))
    if any(size % host for size, host in zip(grid, _HOST_CHIPS, strict=True)):
        options["chips_per_host_bounds"] = tuple(
            min(size, host) for size, host in zip(grid, _HOST_CHIPS, strict=True)
        )
    # On a host without a TPU, libtpu is told it is alone (it prints errors
    # about the TPU VM it cannot find otherwise), for this call only.
    quiet = tpu_host.topology_variables()
    os.environ.update(quiet)
    try:
        description = topologies.get_topology_desc(
            topology_name=name, platform="tpu", **options
        )
    except Exception as error:  # libtpu's runtime error type
        raise ValueError(
            f"libtpu refused the topology {name!r}"
            f"{f' x {num_slices} slices' if num_slices > 1 else ''}: {error}"
        ) from error
    finally:
        for variable in quiet:
            os.environ.pop(variable, None)
    return list(description.devices)


def device_mesh_array(
    devices: list,
    shape: tuple[int, ...],
    num_slices: int,
    slice_axis: int | None = None,
) -> np.ndarray:
    """`devices` arranged as a mesh of `shape`, neighbours in the slice's
    links next to each other (`mesh_utils`); with several slices, axis
    `slice_axis` (default: the first axis that the slice count divides)
    spans the slices (data-center network) and the rest stays within each
    slice."""
    from jax.experimental import mesh_utils  # noqa: PLC0415

    if len(devices) != int(np.prod(shape)):
        raise ValueError(
            f"A mesh of shape {shape} needs {int(np.prod(shape))} devices; the "
            f"topology has {len(devices)}."
        )
    if num_slices == 1:
        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            return np.asarray(devices, dtype=object).reshape(shape)
    if slice_axis is None:
        slice_axis = next(
            (axis for axis, size in enumerate(shape) if size % num_slices == 0), None
        )
    if slice_axis is None or shape[slice_axis] % num_slices:
        raise ValueError(
            f"With {num_slices} slices one mesh axis must span them: no axis "
            f"of shape {shape} is a multiple of {num_slices}."
            if slice_axis is None
            else f"Axis {slice_axis} of the mesh {shape} cannot span "
            f"{num_slices} slices: its size is not a multiple of {num_slices}."
        )
    across = [1] * len(shape)
    across[slice_axis] = num_slices
    within = [size // slices for size, slices in zip(shape, across, strict=True)]
    return mesh_utils.create_hybrid_device_mesh(
        within, across, devices, allow_split_physical_axes=True
    )


def local_memory_bytes() -> int | None:
    """What a program may allocate on the least of this process' devices,
    as the engine reports it (`memory_stats()["bytes_limit"]`), or None
    where it reports none (CPU devices)."""
    limits = []
    for device in jax.local_devices():
        stats = device.memory_stats() if device.platform != "cpu" else None
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            return None
        limits.append(int(limit))
    return min(limits) if limits else None


def mesh_slices(devices: list) -> dict[int, int]:
    """Each device's id and the slice it belongs to (0 for one slice)."""
    return {device.id: getattr(device, "slice_index", 0) or 0 for device in devices}


# -- the steps -----------------------------------------------------------------
def _layout(distribution: Any, variable: Any) -> Any:
    return distribution.layout_for_variable(variable).backend_layout


def state_structs(model: Any, distribution: Any) -> tuple:
    """The model's training state as `jax.ShapeDtypeStruct`s, each with the
    sharding keras_dist gives the variable (an optimizer slot the one of the
    variable it mirrors), in the four lists of Keras' JAX state."""

    def struct(variable: Any, owner: Any = None) -> Any:
        return jax.ShapeDtypeStruct(
            tuple(variable.shape),
            variable.dtype,
            sharding=_layout(distribution, owner if owner is not None else variable),
        )

    def slot(variable: Any, owner: Any) -> Any:
        if owner is None or not is_state_slot(variable):
            return struct(variable, owner)
        # Where `offload=` keeps it, in its `optimizer_state_dtype=`.
        layout = slot_layout(placement, _layout(distribution, owner))
        dtype = variable.dtype
        if placement is not None:
            dtype = placement.slot_dtype(owner.dtype)
        return jax.ShapeDtypeStruct(tuple(variable.shape), dtype, sharding=layout)

    placement = getattr(distribution, "state_placement", None)
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    owners = slot_owners(optimizer, model.trainable_variables) if optimizer else {}
    return (
        [struct(v) for v in model.trainable_variables],
        [struct(v) for v in model.non_trainable_variables],
        [slot(v, owners.get(id(v))) for v in optimizer_variables],
        [struct(v) for v in model.metrics_variables],
    )


def batch_structs(distribution: Any, data: Any) -> Any:
    """The global batch `data` (objects with `shape` and `dtype`) as fit hands
    it to a step: laid out along the batch axis, and padded with a mask when
    its rows do not divide the batch shards."""
    shards = distribution.num_model_replicas
    rows = next(int(leaf.shape[0]) for leaf in jax.tree_util.tree_leaves(data))
    padded = padded_size(rows, shards)

    def struct(leaf: Any, size: int) -> Any:
        shape = (size, *tuple(leaf.shape)[1:])
        sharding = distribution.get_data_layout(shape).backend_layout
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)

    placed = jax.tree_util.tree_map(lambda leaf: struct(leaf, padded), data)
    if padded == rows:
        return placed
    mask = jax.ShapeDtypeStruct(
        (padded,),
        np.float32,
        sharding=distribution.get_data_layout((padded,)).backend_layout,
    )
    return MaskedBatch(placed, mask)


def _state_for(kind: str, state: tuple) -> tuple:
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    if kind == "train":
        return state
    if kind == "test":
        return (trainable, non_trainable, metrics_variables)
    return (trainable, non_trainable)


def _sharding_tree(state: tuple) -> tuple:
    return tuple([leaf.sharding for leaf in part] for part in state)


def compile_step(model: Any, kind: str, state: tuple, batch: Any) -> dict[str, Any]:
    """Lower and compile Keras' jitted `kind` step of `model` on `state` and
    `batch` (abstract), and say what XLA says of it, per device, as the
    fields of `keras_dist.planner.CompiledStep`: a step XLA refuses (out of
    memory, say) comes back with its words as `error`."""
    started = time.perf_counter()
    step = internals.keras_step_function(model, kind, _sharding_tree(state))
    devices = list(jax.tree_util.tree_leaves(batch)[0].sharding.mesh.devices.flat)
    try:
        with internals.platform_seen_by_keras(devices):
            lowered = step.lower(_state_for(kind, state), batch)
        compiled = lowered.compile()
    except Exception as error:  # XLA's runtime error types
        return {
            "kind": kind,
            "compile_seconds": time.perf_counter() - started,
            "error": str(error),
        }
    seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    text = compiled.as_text()
    slices = len(set(mesh_slices(devices).values()))
    moved, counts = collectives(text, len(devices) // slices, slices)
    to_device, to_host = host_transfers(text)
    host = {
        name: int(getattr(memory, f"host_{name}_size_in_bytes", 0) or 0)
        for name in ("argument", "output", "temp", "alias")
    }
    return {
        "kind": kind,
        "compile_seconds": seconds,
        # Arguments + outputs + temporaries + code, less what the outputs
        # alias (the donated state).
        "peak_bytes": int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            + memory.generated_code_size_in_bytes
            - memory.alias_size_in_bytes
        ),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "code_bytes": int(memory.generated_code_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        # The same in the host's memory (pinned_host): offloaded state.
        "host_peak_bytes": host["argument"]
        + host["output"]
        + host["temp"]
        - host["alias"],
        "host_argument_bytes": host["argument"],
        "host_output_bytes": host["output"],
        "host_temp_bytes": host["temp"],
        # What must cross the device's memory at least once: every argument
        # read, every output written (less outputs that are their argument
        # unchanged). XLA's bytes accessed counts traffic fusion never makes.
        "device_traffic_bytes": int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - passed_through_bytes(text)
        ),
        "host_to_device_bytes": to_device,
        "device_to_host_bytes": to_host,
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "collective_bytes": moved,
        "collective_counts": counts,
    }


def _array_bytes(type_text: str) -> list[int]:
    sizes = []
    for element, dims in _ARRAY.findall(type_text):
        bits = _BITS.get(element, 8 if element.startswith("f8") else None)
        if bits is None:
            continue
        count = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        sizes.append(count * bits // 8)
    return sizes


def collectives(
    hlo_text: str, slice_devices: int | None = None, num_slices: int = 1
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per device each kind of collective works on in one run of the
    compiled program `hlo_text`, and how many of each there are.

    The bytes of a collective are its full buffer on one device: what an
    all-gather returns, what a reduce-scatter is given, the buffer an
    all-reduce, all-to-all or collective-permute exchanges. A collective XLA
    placed in several computations (an asynchronous start and its
    continuation) carries one channel id and is counted once.

    `CROSS_SLICE` ("cross-slice") counts the bytes each device sends across
    the `num_slices` slices: for each megascale transfer (a `send` and its
    `recv`) a ring's count of its buffer b, 2 (S - 1) / S x b for an
    all-reduce, (S - 1) x b for an all-gather (b: the shard sent; its
    `recv` brings S of them), (S - 1) / S x b otherwise; and the buffer of a
    collective whose groups hold more than the `slice_devices` devices of
    one slice (counted in its own kind too).

    >>> moved, counts = collectives(
    ...     '%s = (f32[1024]{0}, u32[], token[]) send(%x, %t), channel_id=2, '
    ...     '_xla_host_transfer_rendezvous="all-reduce.3_0",'
    ...     '_xla_megascale_transfer_type="ALL_REDUCE"'
    ... )
    >>> moved["cross-slice"], counts["cross-slice"]
    (4096, 1)
    """
    seen: dict[tuple[str, str], int] = {}
    for line in hlo_text.splitlines():
        sent = _megascale_send(line, num_slices)
        if sent is not None:
            key = (CROSS_SLICE, sent[0])
            seen[key] = max(seen.get(key, 0), sent[1])
            continue
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        op = match.group("op")
        sizes = _array_bytes(match.group("type"))
        if not sizes:
            continue
        if match.group("start") and op in ("all-gather", "collective-permute"):
            # (operands..., results..., contexts...): the largest is the
            # gathered result; a permute's operand and result are equal.
            moved = max(sizes)
        else:
            moved = sum(sizes)
        group = _group_size(line)
        if op == "reduce-scatter":
            moved *= group
        channel = _CHANNEL.search(line)
        key = (op, channel.group(1) if channel else line)
        seen[key] = max(seen.get(key, 0), moved)
        if slice_devices is not None and group > slice_devices:
            seen[(CROSS_SLICE, line)] = moved
    kinds = (*COLLECTIVES, CROSS_SLICE)
    moved_by_kind = dict.fromkeys(kinds, 0)
    groups = dict.fromkeys(kinds, 0)
    for (op, _), size in seen.items():
        moved_by_kind[op] += size
        groups[op] += 1
    return moved_by_kind, groups


def _megascale_send(line: str, num_slices: int) -> tuple[str, int] | None:
    """`(transfer name, bytes this device sends)` of a `send` that crosses
    slices (XLA's megascale transfer), or None."""
    if "_xla_megascale_transfer_type" not in line:
        return None
    match = _MEGASCALE_SEND.search(line)
    if match is None:
        return None
    sizes = _array_bytes(match.group("type"))
    if not sizes:
        return None
    payload = sizes[0]  # then the send's u32 context and a token
    rendezvous = _RENDEZVOUS.search(line)
    channel = _CHANNEL.search(line)
    name = rendezvous.group(1) if rendezvous else channel.group(1) if channel else line
    transfer = _TRANSFER.search(line)
    kind = transfer.group(1) if transfer else ""
    slices = max(num_slices, 2)
    if kind == "ALL_REDUCE":
        share = 2 * (slices - 1) / slices
    elif kind == "ALL_GATHER":
        share = slices - 1
    else:
        share = (slices - 1) / slices
    return name, int(payload * share)


def _layouts(type_text: str) -> list[tuple[int, bool]]:
    """Each array of an HLO type: its bytes and whether it lives in pinned_host."""
    arrays = []
    for match in re.finditer(
        r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\](\{[^}]*\})?",
        type_text,
    ):
        sizes = _array_bytes(f"{match.group(1)}[{match.group(2)}]")
        if sizes:
            arrays.append((sizes[0], _HOST_SPACE in (match.group(3) or "")))
    return arrays


def host_transfers(hlo_text: str) -> tuple[int, int]:
    """Bytes per device the compiled program `hlo_text` moves from pinned_host
    to the device and back in one run.

    Where XLA writes the memory space of each instruction (TPU, GPU), every
    copy between the two spaces counts (`copy-start`'s `(destination,
    source, context)`, a plain `copy`). Where it writes it on the program's
    signature alone (CPU), each argument in pinned_host counts as read once
    and each output there as written once."""
    spaces: dict[str, list[tuple[int, bool]]] = {}
    to_device = to_host = 0
    seen_inside = False
    for line in hlo_text.splitlines():
        match = _DEFINITION.match(line)
        if match is None:
            continue
        arrays = _layouts(match.group("type"))
        spaces[match.group("name")] = arrays
        if any(on_host for _, on_host in arrays):
            seen_inside = True
        op = match.group("op")
        if op == "copy-start" and len(arrays) >= 2:
            (size, destination), (_, source) = arrays[0], arrays[1]
        elif op == "copy" and arrays:
            size, destination = arrays[0]
            operand = match.group("operands").split(",")[0].strip().lstrip("%")
            found = spaces.get(operand)
            if not found:
                continue
            source = found[0][1]
        else:
            continue
        if destination and not source:
            to_host += size
        elif source and not destination:
            to_device += size
    if seen_inside:
        return to_device, to_host
    start = hlo_text.find(_ENTRY_LAYOUT)
    if start < 0:
        return 0, 0
    # The signature `(arguments)->outputs`, up to its closing brace.
    start += len(_ENTRY_LAYOUT)
    depth, end = 1, start
    while end < len(hlo_text) and depth:
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        end += 1
    arguments, _, outputs = hlo_text[start : end - 1].partition(")->")
    read = sum(size for size, on_host in _layouts(arguments) if on_host)
    written = sum(size for size, on_host in _layouts(outputs) if on_host)
    return read, written


def passed_through_bytes(hlo_text: str) -> int:
    """Bytes of the entry computation's outputs that are one of its
    parameters unchanged (a frozen variable the step hands back): written by
    nobody."""
    parameters: dict[str, int] = {}
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if not in_entry:
            continue
        if line.startswith("}"):
            break
        match = _DEFINITION.match(line)
        if match is None:
            continue
        if match.group("op") == "parameter":
            parameters[match.group("name")] = sum(_array_bytes(match.group("type")))
        elif line.lstrip().startswith("ROOT") and match.group("op") == "tuple":
            names = [
                operand.strip().lstrip("%")
                for operand in match.group("operands").split(",")
            ]
            return sum(parameters.get(name, 0) for name in names)
    return 0


_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _group_size(line: str) -> int:
    """The number of devices in each group of the collective on `line`."""
    listed = _GROUPS_LIST.search(line)
    if listed:
        return max(1, len([d for d in listed.group(1).split(",") if d]))
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        names = re.findall(r"'([^']+)'", mesh.group(2))
        return int(np.prod([int(sizes.get(name, 1)) for name in names] or [1]))
    return 1
